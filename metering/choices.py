"""Names of usage outcomes and endpoints."""

from django.db import models


class UsageStatus(models.TextChoices):
    OK = "ok", "Completed"
    ERROR = "error", "Failed"
    CLIENT_CLOSED = "client_closed", "Client disconnected"


class Endpoint(models.TextChoices):
    CHAT = "chat", "/v1/chat/completions"
    COMPLETIONS = "completions", "/v1/completions"
    EMBEDDINGS = "embeddings", "/v1/embeddings"
    MESSAGES = "messages", "/v1/messages"
    COUNT_TOKENS = "count_tokens", "/v1/messages/count_tokens"
    RERANK = "rerank", "/v1/rerank"
    SCORE = "score", "/v1/score"
    RESPONSES = "responses", "/v1/responses"
