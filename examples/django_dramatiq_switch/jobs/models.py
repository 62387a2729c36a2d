from django.db import models


class Run(models.Model):
    """One run of :func:`jobs.tasks.work`: which message, on which side, when (ms since the epoch)."""

    message_id = models.CharField(max_length=64)
    side = models.CharField(max_length=16)
    at_ms = models.BigIntegerField()
