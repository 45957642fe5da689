"""The root filesystem of a sandboxed warm job, built in its own mount namespace.

`init` (`e31_worker.child.warmouter`) builds it from the same bind arguments bubblewrap gets
on the cold path (`Sandbox.bind_args` and the attempt's own): a tmpfs root, each bind made
read-only, nosuid and nodev as bubblewrap makes it, a fresh /proc of the job's PID namespace,
a minimal /dev; then pivot_root into it, the old root detached, the new one read-only.
"""

from __future__ import annotations

import ctypes
import os
import platform

from e31_worker.child.linuxcalls import check, libc

NEW_ROOT = "/run/e31-warm-root"  # mount point of a sandboxed job's root (in its namespace)

# Linux constants (include/uapi/linux/mount.h, fcntl.h; the syscall tables).
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine(), 155)
SYS_MOUNT_SETATTR = 442
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))
SHARED_TMPFS = ("/tmp", "/dev/shm")  # writable by the job (mode 1777), as bubblewrap's are


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def build_root(view: list[str], cwd: str) -> None:
    """The job's root from bubblewrap's bind arguments (`Sandbox.bind_args` and the
    attempt's own), with a fresh /proc of this PID namespace; then pivot_root into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(NEW_ROOT, exist_ok=True)
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    i = 0
    while i < len(view):
        op = view[i]
        if op in ("--proc", "--dev", "--tmpfs"):
            target = _inside(view[i + 1])
            os.makedirs(target, exist_ok=True)
            if op == "--proc":
                _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            elif op == "--dev":
                _make_dev(target)
            else:
                mode = "1777" if view[i + 1] in SHARED_TMPFS else "0755"
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode}")
            i += 2
        elif op in ("--ro-bind", "--ro-bind-try", "--bind", "--dev-bind-try"):
            src, target = view[i + 1], _inside(view[i + 2])
            i += 3
            if op.endswith("-try") and not os.path.exists(src):
                continue
            _mount_point(target, os.path.isdir(src))
            _mount(src, target, None, MS_BIND | MS_REC)
            attrs = MOUNT_ATTR_NOSUID | (0 if op == "--dev-bind-try" else MOUNT_ATTR_NODEV)
            _set_attrs(target, attrs | (MOUNT_ATTR_RDONLY if op.startswith("--ro") else 0))
        elif op == "--symlink":
            target = _inside(view[i + 2])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(view[i + 1], target)
            i += 3
        else:
            i += 1
    os.chdir(NEW_ROOT)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(cwd)


def _inside(path: str) -> str:
    return NEW_ROOT + path


def _mount_point(target: str, is_dir: bool) -> None:
    if os.path.lexists(target):
        return
    if is_dir:
        os.makedirs(target)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


def _make_dev(target: str) -> None:
    """A minimal /dev like bubblewrap's: the harmless nodes bound from the host, fd links."""
    _mount("tmpfs", target, "tmpfs", MS_NOSUID, "mode=0755")
    for name in DEV_NODES:
        if os.path.exists(f"/dev/{name}"):
            _mount_point(f"{target}/{name}", False)
            _mount(f"/dev/{name}", f"{target}/{name}", None, MS_BIND)
    for name, link in DEV_LINKS:
        os.symlink(link, f"{target}/{name}")
    os.mkdir(f"{target}/shm")


def _set_attrs(target: str, attrs: int) -> None:
    """Read-only / nosuid / nodev on a bind and every mount below it (mount_setattr), or on
    the bind alone where the kernel is older than 5.12."""
    attr = _MountAttr(attr_set=attrs)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE,
                     ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        return
    flags = MS_REMOUNT | MS_BIND
    flags |= MS_RDONLY if attrs & MOUNT_ATTR_RDONLY else 0
    flags |= MS_NOSUID if attrs & MOUNT_ATTR_NOSUID else 0
    flags |= MS_NODEV if attrs & MOUNT_ATTR_NODEV else 0
    _mount(None, target, None, flags)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    check(libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {target}")
