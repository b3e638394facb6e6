"""Request parsers of the admin API (imported by DRF's settings: nothing here may import
DRF's views)."""

from typing import Any

from rest_framework import exceptions
from rest_framework.parsers import JSONParser


class ObjectJSONParser(JSONParser):
    """JSON bodies, which must be objects: every write endpoint takes named fields."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        data = super().parse(stream, media_type, parser_context)
        if not isinstance(data, dict):
            raise exceptions.ParseError("The body must be a JSON object.")
        return data
