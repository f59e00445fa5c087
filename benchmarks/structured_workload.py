"""The structured-output workload: twenty chat questions, each with the JSON schema its answer must follow (nested
objects, arrays, enums, bounded numbers, required fields, `additionalProperties: false`, strings with patterns),
and tools for calls. tests/test_real_model.py holds every answer valid; benchmarks/structured_outputs.py times them.

Strings carry a length bound or a pattern: a 135M model asked for free text inside JSON can write until max_tokens,
and an answer cut short is no JSON at all, whatever the grammar allowed."""
from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
WORD = {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Give the capital of France as JSON.", _obj({"city": NAME, "country": NAME})),
    ("Describe a cat as JSON.", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                      "indoor": {"type": "boolean"}})),
    ("List three primary colors as JSON.", _obj({"colors": {"type": "array", "items": WORD, "minItems": 3,
                                                            "maxItems": 3}})),
    ("Rate the movie Jaws from 1 to 5 as JSON.", _obj({"title": NAME, "stars": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 5}})),
    ("Is water wet? Answer as JSON.", _obj({"answer": {"enum": ["yes", "no", "unsure"]}})),
    ("Give a temperature in Celsius for a warm day as JSON.",
     _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}})),
    ("Describe a book as JSON.", _obj({"title": NAME, "author": _obj({"first": WORD, "last": WORD}),
                                       "year": {"type": "integer", "minimum": 1000, "maximum": 2030}})),
    ("Give a US phone number as JSON.", _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    ("Give today's date as JSON.", _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("List two fruits and their colors as JSON.",
     _obj({"fruits": {"type": "array", "items": _obj({"fruit": WORD, "color": WORD}), "minItems": 2,
                      "maxItems": 2}})),
    ("Describe a point on a map as JSON.", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                  "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("Give the status of a server as JSON.", _obj({"status": {"enum": ["up", "down", "degraded"]},
                                                    "uptime_days": {"type": "integer", "minimum": 0,
                                                                    "maximum": 9999}})),
    ("Describe a person as JSON; the email is optional.",
     _obj({"name": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
           "age": {"type": "integer", "minimum": 0, "maximum": 120}}, required=["name", "age"])),
    ("Give an HTTP response as JSON.", _obj({"code": {"enum": [200, 301, 404, 500]},
                                             "headers": _obj({"content_type": {"enum": ["text/html",
                                                                                        "application/json"]}})})),
    ("List up to four prime numbers as JSON.", _obj({"primes": {"type": "array", "items": {
        "type": "integer", "minimum": 2, "maximum": 97}, "minItems": 1, "maxItems": 4}})),
    ("Describe the weather in Paris as JSON.", _obj({"city": NAME, "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                                      "celsius": {"type": "integer", "minimum": -30,
                                                                  "maximum": 45}})),
    ("Give a hex color for red as JSON.", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}})),
    ("Describe a shopping cart as JSON.",
     _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                                      "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                     "minItems": 1, "maxItems": 3}, "paid": {"type": "boolean"}})),
    ("Give a version number as JSON.", _obj({"major": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "minor": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "label": {"anyOf": [{"type": "null"}, WORD]}})),
    ("Classify the sentence 'I love it' as JSON.",
     _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
           "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": _obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": _obj({"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}})}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Is it raining in London?",
                  "Tell me the time in New York.", "How warm is it in Rome today?", "What is the time in Berlin?"]
