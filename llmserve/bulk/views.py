"""The OpenAI Files (purpose "batch") and Batches endpoints. Callers see only their own API key's files and
batches; without keys (``OPEN_ACCESS``) everything is shared."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from llmserve import conf
from llmserve.api import errors
from llmserve.api.decorators import api_view
from llmserve.auth import Principal
from llmserve.bulk import batches, services
from llmserve.bulk.models import Batch, BatchFile


def _owned(model: type[BatchFile] | type[Batch], principal: Principal) -> Any:
    return model.objects.filter(owner=principal.key)


@api_view(("POST",))
async def file_create(request: HttpRequest, principal: Principal) -> HttpResponse:
    purpose = request.POST.get("purpose")
    upload = request.FILES.get("file")
    if purpose != BatchFile.Purpose.BATCH:
        raise errors.BadRequest('Only `purpose` "batch" is supported.', param="purpose")
    if upload is None:
        raise errors.BadRequest("Send the file as the multipart field `file`.", param="file")
    limit = conf.get("BULK_MAX_FILE_BYTES")
    if upload.size > limit:
        raise errors.PayloadTooLarge(f"The file exceeds {limit} bytes.")
    created = await BatchFile.objects.acreate(
        owner=principal.key, purpose=purpose, filename=upload.name or "upload.jsonl", content=upload.read()
    )
    return JsonResponse(created.as_openai())


async def _file(principal: Principal, file_id: str) -> BatchFile:
    found = await _owned(BatchFile, principal).filter(pk=file_id).afirst()
    if found is None:
        raise errors.NotFound(f"No such File object: {file_id}", param="file_id")
    return found


@api_view(("GET",))
async def file_detail(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    return JsonResponse((await _file(principal, file_id)).as_openai())


@api_view(("GET",))
async def file_content(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    found = await _file(principal, file_id)
    return HttpResponse(bytes(found.content), content_type="application/jsonl")


@api_view(("POST",), json_body=True)
async def batch_create(request: HttpRequest, body: dict[str, Any], principal: Principal) -> HttpResponse:
    input_file = await _file(principal, str(body.get("input_file_id")))
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise errors.BadRequest("`metadata` must map strings to strings.", param="metadata")
    batch = await sync_to_async(batches.create_batch)(
        input_file,
        str(body.get("endpoint")),
        str(body.get("completion_window", "24h")),
        metadata,
        principal.key,
    )
    return JsonResponse(await sync_to_async(batches.as_openai)(batch))


async def _batch(principal: Principal, batch_id: str) -> Batch:
    found = await _owned(Batch, principal).select_related("job").filter(pk=batch_id).afirst()
    if found is None:
        raise errors.NotFound(f"No such Batch object: {batch_id}", param="batch_id")
    return found


@api_view(("GET",))
async def batch_detail(request: HttpRequest, principal: Principal, batch_id: str) -> HttpResponse:
    return JsonResponse(await sync_to_async(batches.as_openai)(await _batch(principal, batch_id)))


@api_view(("POST",))
async def batch_cancel(request: HttpRequest, principal: Principal, batch_id: str) -> HttpResponse:
    batch = await _batch(principal, batch_id)
    await sync_to_async(services.cancel_job)(batch.job)
    await batch.job.arefresh_from_db()
    return JsonResponse(await sync_to_async(batches.as_openai)(batch))


@api_view(("GET",))
async def batch_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    try:
        limit = min(max(int(request.GET.get("limit", 20)), 1), 100)
    except ValueError:
        raise errors.BadRequest("`limit` must be an integer.", param="limit") from None
    found = _owned(Batch, principal).select_related("job").order_by("-created_at", "-pk")
    after = request.GET.get("after")
    if after:
        anchor = await _batch(principal, after)
        found = (
            found.filter(created_at__lte=anchor.created_at)
            .exclude(pk=anchor.pk)
            .exclude(created_at=anchor.created_at, pk__gt=anchor.pk)
        )
    page = [b async for b in found[: limit + 1]]
    data = [await sync_to_async(batches.as_openai)(b) for b in page[:limit]]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }
    )


@csrf_exempt
async def batch_collection(request: HttpRequest) -> HttpResponse:
    """``/v1/batches``: POST creates, GET lists (each view answers 405 for what it does not take)."""
    return await (batch_create if request.method == "POST" else batch_list)(request)
