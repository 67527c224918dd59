"""``/v1/files``: OpenAI's Files API, of which the Batch API's views (`llmserve.bulk.views`) serve the
upload and the retrieval; here the listing (``purpose``, ``limit``, ``after``, ``order``) and the deletion.
A key sees and deletes only its own files, as there."""

from __future__ import annotations

from django.db.models import ProtectedError, Q
from django.db.models.functions import Length
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from llmserve.api import errors
from llmserve.api.decorators import api_view
from llmserve.auth import Principal
from llmserve.bulk import views as bulk_views
from llmserve.bulk.models import BatchFile

MAX_LIMIT = 10_000  # OpenAI's bound and default


def _int(request: HttpRequest, name: str, default: int, low: int, high: int) -> int:
    raw = request.GET.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise errors.BadRequest(f"`{name}` must be an integer in [{low}, {high}].", param=name)
    return int(raw)


@api_view(("GET",))
async def file_list(request: HttpRequest, principal: Principal) -> HttpResponse:
    limit = _int(request, "limit", MAX_LIMIT, 1, MAX_LIMIT)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.BadRequest('`order` must be "asc" or "desc".', param="order")
    # The listing reads each file's size, never its content.
    found = BatchFile.objects.filter(owner=principal.key).defer("content").annotate(size=Length("content"))
    purpose = request.GET.get("purpose")
    if purpose:
        found = found.filter(purpose=purpose)
    sign = "-" if order == "desc" else ""
    found = found.order_by(f"{sign}created_at", f"{sign}pk")
    after = request.GET.get("after")
    if after:
        anchor = (
            await BatchFile.objects.filter(owner=principal.key, pk=after).only("pk", "created_at").afirst()
        )
        if anchor is None:
            raise errors.NotFound(f"No such File object: {after}", param="after")
        op = "lt" if order == "desc" else "gt"
        found = found.filter(
            Q(**{f"created_at__{op}": anchor.created_at})
            | Q(created_at=anchor.created_at, **{f"pk__{op}": anchor.pk})
        )
    page = [f async for f in found[: limit + 1]]
    data = [_listed(f) for f in page[:limit]]
    return JsonResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }
    )


def _listed(found: BatchFile) -> dict:
    """`BatchFile.as_openai` from the annotated size, without loading the content."""
    return {
        "id": found.id,
        "object": "file",
        "bytes": found.size,
        "created_at": int(found.created_at.timestamp()),
        "filename": found.filename,
        "purpose": found.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


@api_view(("DELETE",))
async def file_delete(request: HttpRequest, principal: Principal, file_id: str) -> HttpResponse:
    found = await BatchFile.objects.filter(owner=principal.key, pk=file_id).only("pk").afirst()
    if found is None:
        raise errors.NotFound(f"No such File object: {file_id}", param="file_id")
    try:
        await found.adelete()
    except ProtectedError:
        raise errors.BadRequest(
            f"The file {file_id} is the input of a batch; it can be deleted with the batch only.",
            param="file_id",
            code="file_in_use",
        ) from None
    return JsonResponse({"id": file_id, "object": "file", "deleted": True})


@csrf_exempt
async def collection(request: HttpRequest) -> HttpResponse:
    """``/v1/files``: POST uploads (the Batch API's view), anything else lists (405 for what it does not
    take). Django reads no form fields from a body of unknown length: such an upload is refused as such."""
    if request.method == "POST":
        if not request.META.get("CONTENT_LENGTH"):
            return errors.LengthRequired("Send the upload with a Content-Length header.").response()
        return await bulk_views.file_create(request)
    return await file_list(request)


@csrf_exempt
async def item(request: HttpRequest, file_id: str) -> HttpResponse:
    """``/v1/files/{id}``: DELETE deletes, anything else retrieves."""
    if request.method == "DELETE":
        return await file_delete(request, file_id=file_id)
    return await bulk_views.file_detail(request, file_id=file_id)


collection.llmserve_api = item.llmserve_api = True  # views of `api_view`s: `llmserve.routing.APIRouter`
