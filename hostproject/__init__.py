"""The repository's own host project: it uses the llmserve app exactly as any project would."""

# Celery's Django convention: the app is loaded with Django so that @shared_task binds to it.
from hostproject.celery import app as celery_app

__all__ = ["celery_app"]
