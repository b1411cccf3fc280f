from django.db import models


class Payment(models.Model):
    principal = models.CharField(max_length=255)
    amount = models.IntegerField()
    via = models.CharField(max_length=16)
