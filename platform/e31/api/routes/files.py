"""`/v1/files`: OpenAI's Files API for a tenant's batch files (`e31.api.services.files`), so
that the official `openai` client works with the tenant's token as its API key.

An upload is a multipart form (`file`, `purpose=batch`), bounded by `batch_file_max_bytes`
rather than the request body limit (the app bounds `FILES_PATH` by that setting instead).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import DIGITS
from e31.api.services.files import FileService
from e31.store.batches import LIST_MAX, FileRecord

FILES_PATH = "/v1/files"
READ_CHUNK_BYTES = 1024 * 1024


def listing(records: list[Any], limit: int) -> dict[str, Any]:
    """OpenAI's list object over `records` (dicts with an `id`) asked with `limit`."""
    return {"object": "list", "data": records, "has_more": len(records) >= limit,
            "first_id": records[0]["id"] if records else None,
            "last_id": records[-1]["id"] if records else None}


def router(svc: FileService) -> APIRouter:
    """The routes of `/v1/files`."""
    r = APIRouter()

    @r.post(FILES_PATH, tags=["files"], responses=errors.responses(401, 413, 422, 503, openai=True))
    async def upload_file(file: UploadFile, purpose: Annotated[Literal["batch"], Form()],
                          t: Caller) -> dict[str, Any]:
        """Upload a JSONL file of requests for a batch (`purpose=batch`)."""
        record = await run_in_threadpool(svc.upload, t, file.file,
                                         filename=file.filename or "", purpose=purpose)
        return record.to_dict()

    @r.get(FILES_PATH, tags=["files"], responses=errors.responses(401, 422, 503, openai=True))
    def list_files(t: Caller,
                   purpose: Annotated[Literal["batch", "batch_output"] | None, Query()] = None,
                   limit: Annotated[int, Query(ge=1, le=LIST_MAX), DIGITS] = LIST_MAX,
                   after: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
        """Your files, newest first."""
        found = svc.list(t, purpose=purpose, limit=limit, after=after)
        return listing([f.to_dict() for f in found], limit)

    @r.get(FILES_PATH + "/{file_id}", tags=["files"],
           responses=errors.responses(401, 404, 422, 503, openai=True))
    def get_file(file_id: str, t: Caller) -> dict[str, Any]:
        return svc.get(t, file_id).to_dict()

    @r.get(FILES_PATH + "/{file_id}/content", tags=["files"], response_class=StreamingResponse,
           responses={200: {"content": {"application/octet-stream": {}}},
                      **errors.responses(401, 404, 422, 503, openai=True)})
    def file_content(file_id: str, t: Caller) -> StreamingResponse:
        """The file's bytes."""
        f = svc.open(t, file_id)

        def chunks() -> Any:
            with f:
                while chunk := f.read(READ_CHUNK_BYTES):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    @r.delete(FILES_PATH + "/{file_id}", tags=["files"],
              responses=errors.responses(401, 404, 422, 503, openai=True))
    def delete_file(file_id: str, t: Caller) -> dict[str, Any]:
        record: FileRecord = svc.delete(t, file_id)
        return {"id": record.id, "object": "file", "deleted": True}

    return r
