"""Bulk jobs on Celery: many prompts through the bus at a low priority, and the OpenAI Batch API on top.

``services`` is the Python API for host projects, ``tasks`` the Celery tasks that drive a job, ``runner`` the
loop they run (with ``bus_thread`` for its requests and ``capacity`` for how many to keep in flight),
``views`` the Batch API endpoints, ``uploads`` the reading of uploaded files and writing of result files, and
``admin`` the upload form, live progress, controls and downloads.
"""
