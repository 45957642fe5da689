"""The exit codes of a worker process (`celery_process`), which its launcher reads to decide
whether to start it again. Apart from both so that the launcher, which imports this, does not
import Celery and the attempt machinery it never runs (about 0.5 s of each `e31 up`'s start)."""

EXIT_NODE_TAKEN = 3  # the launcher retries with back-off: the node may free up
EXIT_DRAINED = 4     # an operator drained this node: the launcher does not restart it
EXIT_THREAD_DIED = 5  # a thread died of an unexpected exception: the launcher restarts it
