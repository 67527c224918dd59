"""The Batch API's routes; ``llmserve.urls`` includes them at the root, next to the other /v1/ endpoints."""

from django.urls import path

from llmserve.bulk import views

urlpatterns = [
    path("v1/files", views.file_create, name="file-create"),
    path("v1/files/<str:file_id>", views.file_detail, name="file-detail"),
    path("v1/files/<str:file_id>/content", views.file_content, name="file-content"),
    path("v1/batches", views.batch_collection, name="batch-collection"),
    path("v1/batches/<str:batch_id>", views.batch_detail, name="batch-detail"),
    path("v1/batches/<str:batch_id>/cancel", views.batch_cancel, name="batch-cancel"),
]
