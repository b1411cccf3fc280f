from django.db import models


class Payment(models.Model):  # type: ignore[misc]  # Django has no types here
    amount = models.IntegerField()
