"""The structured-output suite's schemas, each with a realistic prompt: the hand-written
ones in structured_schemas.json beside this file (nested objects, arrays with
minItems/maxItems, enums, optional and nullable fields, bounded numbers and integers,
anyOf/oneOf/allOf, const, prefixItems, additionalProperties, string patterns and the
formats llguidance enforces: date, time, date-time, duration, email, uuid, ipv4, ipv6,
hostname, uri), and those pydantic writes ($defs and $ref, anyOf for Optional, enums,
a recursive model), built here from models.

`check(schema, text)` says why a reply does not parse or validate (None when it does),
with the formats checked too."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date
from enum import Enum
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, Field

FIXTURE = Path(__file__).with_name("structured_schemas.json")
# A few schemas across the kinds, for the default (short) run
SHORT = ("person", "book", "contact", "payment", "calendar", "order", "nullable_name", "support_ticket")
# Formats llguidance does not enforce: the engine refuses a schema that names one
UNENFORCED_FORMATS = ("uri-reference", "iri", "idn-email", "json-pointer", "regex")


@dataclass(frozen=True)
class SchemaCase:
    """One schema of the suite and the prompt that asks for it."""

    name: str
    prompt: str
    schema: dict


class Priority(str, Enum):
    """A support ticket's or an order's urgency."""

    low = "low"
    normal = "normal"
    urgent = "urgent"


class Address(BaseModel):
    """A postal address."""

    street: str = Field(max_length=80)
    city: str = Field(max_length=40)
    postcode: str = Field(max_length=12)
    country: str = Field(max_length=40)


class Item(BaseModel):
    """One line of an order."""

    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    quantity: int = Field(ge=1, le=20)
    unit_price: float = Field(ge=0)


class Order(BaseModel):
    """An order: nested address, a list of items, an enum, optional fields."""

    order_id: int = Field(ge=1)
    customer: str = Field(max_length=60)
    email: Optional[str] = Field(default=None, max_length=60)
    shipping: Address
    items: list[Item] = Field(min_length=1, max_length=4)
    priority: Priority
    notes: Optional[str] = Field(default=None, max_length=120)


class LineItem(BaseModel):
    """One line of an invoice."""

    description: str = Field(max_length=80)
    hours: float = Field(ge=0, le=200)
    rate: float = Field(ge=0)


class Invoice(BaseModel):
    """An invoice with a due date."""

    number: str = Field(pattern=r"^INV-[0-9]{4}$")
    client: Address
    lines: list[LineItem] = Field(min_length=1, max_length=3)
    due: date
    paid: bool


class SupportTicket(BaseModel):
    """A support ticket: Literal, Optional and a list of tags."""

    title: str = Field(max_length=80)
    product: Literal["laptop", "phone", "tablet", "other"]
    priority: Priority
    assignee: Optional[str] = Field(default=None, max_length=40)
    tags: list[str] = Field(default_factory=list, max_length=3)


class Ingredient(BaseModel):
    """An ingredient and its amount."""

    name: str = Field(max_length=40)
    grams: int = Field(ge=0, le=5000)


class Step(BaseModel):
    """One step of a recipe."""

    number: int = Field(ge=1, le=10)
    instruction: str = Field(max_length=120)


class Recipe(BaseModel):
    """A recipe: two lists of nested models."""

    title: str = Field(max_length=60)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=5)
    steps: list[Step] = Field(min_length=1, max_length=4)
    minutes: int = Field(ge=1, le=600)


class Comment(BaseModel):
    """A comment and its replies: a recursive model."""

    author: str = Field(max_length=30)
    text: str = Field(max_length=120)
    replies: list["Comment"] = Field(default_factory=list, max_length=2)


class Job(BaseModel):
    """One position on a résumé."""

    company: str = Field(max_length=60)
    title: str = Field(max_length=60)
    years: int = Field(ge=0, le=50)


class Resume(BaseModel):
    """A résumé: a skills list and a list of jobs."""

    name: str = Field(max_length=60)
    skills: list[str] = Field(min_length=1, max_length=5)
    experience: list[Job] = Field(min_length=1, max_length=3)


class Employee(BaseModel):
    """An employee record: a dict of integers (additionalProperties), a Literal with a default."""

    name: str = Field(max_length=60)
    level: Literal["junior", "mid", "senior"] = "mid"
    manager_id: Optional[int] = None
    leave_days: dict[str, int] = Field(default_factory=dict, max_length=3)


PYDANTIC = [
    ("order", "Create an order as JSON for two boxes of tea and a mug, shipped to Bristol, UK.", Order),
    ("invoice", "Write an invoice as JSON for 12 hours of consulting at 90 euros an hour, due at the end of next month.",
     Invoice),
    ("support_ticket", "File a support ticket as JSON: a customer's phone screen flickers after the latest update.",
     SupportTicket),
    ("recipe_steps", "Write a recipe for a tomato omelette as JSON with its ingredients in grams and its steps.",
     Recipe),
    ("comment_thread", "Write a short online comment about a new bike lane, with one reply, as JSON.", Comment),
    ("resume", "Write a short résumé as JSON for a junior data analyst.", Resume),
    ("employee", "Create an employee record as JSON for a senior engineer with their remaining leave days.", Employee),
]


def cases() -> list[SchemaCase]:
    """Every schema of the suite: the fixture's, then pydantic's."""
    fixed = [SchemaCase(**c) for c in json.loads(FIXTURE.read_text())]
    return fixed + [SchemaCase(name, prompt, model.model_json_schema()) for name, prompt, model in PYDANTIC]


# The formats jsonschema checks only with optional packages installed, checked here
# (RFC 3339 date-time and full-time, ISO 8601 duration, RFC 1123 hostname, an absolute URI)
FORMATS = {
    "date-time": r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})",
    "time": r"\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})",
    "duration": r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?",
    "hostname": r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[^\s]*",
}


def _format_checker():
    import jsonschema

    checker = jsonschema.FormatChecker()
    for name, pattern in FORMATS.items():
        checker.checks(name)(lambda value, p=re.compile(pattern): not isinstance(value, str) or bool(p.fullmatch(value)))
    return checker


def check(schema: dict, text: str) -> str | None:
    """Why `text` is not a JSON instance of `schema` (formats included), or None."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=_format_checker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"invalid: {error.message} at {list(error.absolute_path)}"
