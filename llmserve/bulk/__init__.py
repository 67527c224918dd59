"""Bulk jobs on Celery: many prompts through the bus at a low priority, and the OpenAI Batch API on top.

``services`` is the Python API for host projects, ``tasks`` the Celery tasks that drive a job, ``runner`` the
loop they run, ``views`` the Batch API endpoints and ``admin`` the upload form and progress display.
"""
