"""What users put in a job reaches the admin safely: result CSVs escape cells a spreadsheet would run as
formulas, the job views answer ids that are no job's with 404, and an upload with a lone surrogate is refused
with its line. No stack needed: the admin views and the export run in process."""

from __future__ import annotations

import csv
import io

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from llmserve.bulk import uploads
from llmserve.bulk.models import BulkItem, BulkJob


def test_csv_cells_that_start_a_formula_are_escaped() -> None:
    row = {
        "index": 0,
        "custom_id": '=HYPERLINK("http://evil.example","click")',
        "status": "done",
        "output": "+1+1",
        "error": None,
        "prompt_tokens": 3,
        "completion_tokens": -1,  # a number stays a number
        "input": {"document": "@SUM(A1)"},
        "response": None,
    }
    text = b"".join(uploads.csv_lines([row, {**row, "custom_id": "plain", "output": "- a list"}])).decode()
    first, second = csv.DictReader(io.StringIO(text))
    assert first["custom_id"] == "'" + row["custom_id"]
    assert first["output"] == "'+1+1" and first["completion_tokens"] == "-1"
    assert first["input"] == '{"document": "@SUM(A1)"}'  # JSON text starts with a brace: harmless
    assert second["custom_id"] == "plain" and second["output"] == "'- a list"


@pytest.mark.django_db
@pytest.mark.parametrize("object_id", ["abc", "99999999999999999999", "-1", "1.5", "%00"])
@pytest.mark.parametrize("view", ["progress", "results", "control"])
def test_job_views_answer_malformed_ids_with_404(admin_client, object_id, view) -> None:
    if view == "progress":
        url = reverse("admin:llmserve_bulkjob_progress", args=[object_id])
    elif view == "results":
        url = reverse("admin:llmserve_bulkjob_results", args=[object_id, "csv"])
    else:
        url = reverse("admin:llmserve_bulkjob_control", args=[object_id, "pause"])
    reply = admin_client.post(url) if view == "control" else admin_client.get(url)
    assert reply.status_code == 404, (url, reply.status_code)


@pytest.mark.django_db
def test_job_views_still_find_a_job(admin_client) -> None:
    job = BulkJob.objects.create(model="m", template="{x}", params={})
    BulkItem.objects.create(job=job, index=0, input={"x": "y"})
    reply = admin_client.get(reverse("admin:llmserve_bulkjob_progress", args=[job.pk]))
    assert reply.status_code == 200 and reply.json()["total"] == 0


def test_an_upload_with_a_lone_surrogate_is_refused_with_its_line() -> None:
    upload = SimpleUploadedFile("docs.jsonl", b'{"document": "fine"}\n{"document": "bad \\ud800"}\n')
    with pytest.raises(uploads.UploadError, match=r"Line 2: `document` holds a lone surrogate"):
        uploads.count_items(upload)
