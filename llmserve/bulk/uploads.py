"""Items from an uploaded file, and results to a downloaded one (and a finished batch's output and error
files), a line at a time.

An upload is read twice, never held whole: once to validate it (a bad line refuses the whole file, before any
item exists) and once, from its start, while the items are inserted a thousand at a time. Django keeps large
uploads in a temporary file, so neither pass needs more memory than a line.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterable, Iterator
from typing import Any

from django.core.files.uploadedfile import UploadedFile

from llmserve.api.schema import lone_surrogate
from llmserve.bulk.models import Batch, BatchFile, BulkItem


class UploadError(ValueError):
    pass


def iter_items(upload: UploadedFile) -> Iterator[dict[str, Any]]:
    """The items of a ``.jsonl`` (one object per line) or ``.csv`` (a header row, then one item per row)
    file, from its start; `UploadError` names the first bad line."""
    upload.seek(0)
    lines = codecs.iterdecode(upload, "utf-8-sig")
    try:
        if (upload.name or "").lower().endswith(".csv"):
            yield from _csv_items(lines)
        else:
            yield from _jsonl_items(lines)
    except UnicodeDecodeError:
        raise UploadError("The file is not UTF-8 text.") from None


def _jsonl_items(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise UploadError(f"Line {number} is not valid JSON.") from None
        if not isinstance(item, dict):
            raise UploadError(f"Line {number} is not a JSON object.")
        where = lone_surrogate(item)
        if where is not None:
            raise UploadError(f"Line {number}: `{where}` holds a lone surrogate (\\uD800-\\uDFFF), not text.")
        yield item


def _csv_items(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    reader = csv.DictReader(lines)
    try:
        for row in reader:
            if None in row:
                raise UploadError(f"Line {reader.line_num} has more fields than the header.")
            yield row
    except csv.Error as exc:
        raise UploadError(f"Line {reader.line_num}: {exc}.") from None


def count_items(upload: UploadedFile) -> int:
    """Validate the whole upload; the number of items."""
    return sum(1 for _ in iter_items(upload))


RESULT_COLUMNS = ("index", "custom_id", "status", "output", "error", "prompt_tokens", "completion_tokens")


def jsonl_lines(results: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    """One JSON object per item: its result with its input, so a line stands on its own."""
    for row in results:
        yield json.dumps(row, ensure_ascii=False).encode() + b"\n"


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (``=HYPERLINK(...)``, ``+1``, ``@SUM``...) starts
    with an apostrophe, which spreadsheets show as plain text (OWASP's advice for CSV injection)."""
    return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_START) else value


def csv_lines(results: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    """One row per item; ``input`` and (Batch API items) ``response`` as JSON text; text cells escaped
    with `csv_cell`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow((*RESULT_COLUMNS, "input", "response"))
    yield buffer.getvalue().encode()
    for row in results:
        buffer.seek(0)
        buffer.truncate()
        error = row["error"]["message"] if row["error"] else ""
        cells = (
            *(error if column == "error" else row[column] for column in RESULT_COLUMNS),
            json.dumps(row["input"], ensure_ascii=False),
            json.dumps(row["response"], ensure_ascii=False) if row["response"] is not None else "",
        )
        writer.writerow([csv_cell(cell) for cell in cells])
        yield buffer.getvalue().encode()


def write_result_files(batch: Batch) -> None:
    """The output file (successful requests) and error file (refused ones); each only if it has lines."""
    job = batch.job
    files = {BulkItem.Status.DONE: io.BytesIO(), BulkItem.Status.FAILED: io.BytesIO()}
    items = (
        job.items.exclude(status=BulkItem.Status.PENDING)
        .order_by("index")
        .only("index", "custom_id", "status", "attempts", "response", "error")
    )
    for item in items.iterator(chunk_size=1000):  # rows per query
        request_id = job.request_id(item.index, item.attempts)
        if item.status == BulkItem.Status.DONE:
            response = {"status_code": 200, "request_id": request_id, "body": item.response}
        else:
            error = dict(item.error or {})
            status = error.pop("status_code", 500)
            response = {"status_code": status, "request_id": request_id, "body": {"error": error}}
        line = {
            "id": f"batch_req_{item.pk}",
            "custom_id": item.custom_id,
            "response": response,
            "error": None,
        }
        files[item.status].write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
    for status, field, suffix in (
        (BulkItem.Status.DONE, "output_file", "output"),
        (BulkItem.Status.FAILED, "error_file", "errors"),
    ):
        if files[status].tell():
            created = BatchFile.objects.create(
                owner=batch.owner,
                purpose=BatchFile.Purpose.BATCH_OUTPUT,
                filename=f"{batch.id}_{suffix}.jsonl",
                content=files[status].getvalue(),
            )
            setattr(batch, field, created)
    batch.save(update_fields=["output_file", "error_file"])
