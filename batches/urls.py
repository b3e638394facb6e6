"""OpenAI's Files and Batch APIs under ``/v1`` (the gateway leaves these paths to Django)."""

from django.urls import path

from batches import views

urlpatterns = [
    path("v1/files", views.files, name="v1-files"),
    path("v1/files/<str:file_id>", views.file_detail, name="v1-file"),
    path("v1/files/<str:file_id>/content", views.file_content, name="v1-file-content"),
    path("v1/batches", views.batches, name="v1-batches"),
    path("v1/batches/<str:batch_id>", views.batch_detail, name="v1-batch"),
    path("v1/batches/<str:batch_id>/cancel", views.batch_cancel, name="v1-batch-cancel"),
]
