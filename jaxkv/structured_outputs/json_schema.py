"""Rewrites of a request's JSON schema before llguidance compiles it. Each one only narrows what
the schema accepts, so whatever the grammar lets through still validates against the schema
the client sent.

- `close_objects`: objects that declare properties and say nothing of ``additionalProperties``
  get ``false`` (OpenAI's strict mode; vLLM's default backend, xgrammar, reads them so).
- `bound_numbers`: every number has at most MAX_INTEGER_DIGITS digits before the point and
  MAX_FRACTION_DIGITS after it, and no exponent, so a model cannot write digits until
  ``max_tokens`` (``1.1111111111111111555333...``). Typed numbers get JSON Schema bounds
  (``exclusiveMinimum``/``exclusiveMaximum`` of 10**16, ``multipleOf`` 1e-10), which llguidance
  compiles into a finite number rule; values a schema leaves free (``json_object``, an open
  ``additionalProperties``, arrays without ``items``, a schema of annotations only such as
  pydantic's ``Any``) get a recursive any-JSON-value definition whose numbers carry the same
  bounds. Left as written: a schema whose own bounds lie beyond 10**16 (that side), the
  inside of a nested ``$id`` resource, and a schema the bounds would make unsatisfiable
  (params.StructuredOutputsParams.validate compiles it unbounded then).
"""

from __future__ import annotations

MAX_INTEGER_DIGITS = 16  # as llama.cpp's JSON grammar bounds the integer part
MAX_FRACTION_DIGITS = 10  # the finest multipleOf llguidance takes exactly (1e-11 is refused)

ANY_VALUE = "jaxkv_any_value"  # the $defs entry free values point to
_ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}

_SUBSCHEMA = ("items", "additionalProperties", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# "not" and "if" are left alone: narrowing inside them would widen the schema.


_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly"}
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _map_subschemas(schema: dict, fn) -> dict:
    """A copy of `schema` with `fn` applied to each direct subschema."""
    out = dict(schema)
    for k in _SUBSCHEMA:
        if isinstance(out.get(k), dict):
            out[k] = fn(out[k])
    if isinstance(out.get("items"), list):  # draft 4's tuple form
        out["items"] = [fn(x) for x in out["items"]]
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [fn(s) for s in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: fn(s) for n, s in out[k].items()}
    return out


def close_objects(schema):
    """A copy of `schema` where every object schema that declares properties and says nothing
    of additionalProperties gets false. An object without declared properties
    ({"type": "object"}, or one whose keys come from anyOf branches) is left open: false there
    would allow no key at all."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, close_objects)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _types(schema: dict) -> set:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _bound_number(schema: dict) -> dict:
    """Numeric bounds added where the schema sets none of its own."""
    types = _types(schema)
    untyped_number = not types and any(k in schema for k in _NUMERIC)  # numbers only, if any
    if not (types & {"number", "integer"} or untyped_number) or "const" in schema or "enum" in schema:
        return schema
    out = dict(schema)
    top = 10 ** MAX_INTEGER_DIGITS
    lo = _number(out.get("minimum", out.get("exclusiveMinimum")))
    hi = _number(out.get("maximum", out.get("exclusiveMaximum")))
    if "minimum" not in out and "exclusiveMinimum" not in out and (hi is None or hi > -top):
        out["exclusiveMinimum"] = -top
    if "maximum" not in out and "exclusiveMaximum" not in out and (lo is None or lo < top):
        out["exclusiveMaximum"] = top
    if ("number" in types or untyped_number) and "multipleOf" not in out:
        out["multipleOf"] = float(f"1e-{MAX_FRACTION_DIGITS}")
    return out


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _free(sub) -> bool:
    """Any JSON value: true, {}, or a schema of annotations only ({"title": "Payload"}, as
    pydantic writes an Any field)."""
    return sub is True or (isinstance(sub, dict) and set(sub) <= _ANNOTATIONS)


def _bound_free_values(schema: dict) -> dict:
    """Values the schema leaves free (an open object's other keys, an array's unset items)
    point to the bounded any-value definition."""
    out = dict(schema)
    types = _types(out)
    is_object = "object" in types or "properties" in out
    if is_object and _free(out.get("additionalProperties", True)):
        out["additionalProperties"] = _ANY_REF
    if "array" in types and _free(out.get("items", True)):
        out["items"] = _ANY_REF
    return out


def _bound(schema, skip: frozenset, numbers: bool = True):
    """bound_numbers below the root. numbers=False inside allOf branches, whose bounds meet
    the other branches' (10**16 against a sibling's minimum 1e17 would leave no number);
    `skip`: $defs names referenced there or beside numeric keywords, left as written."""
    if _free(schema):
        return {**(schema if isinstance(schema, dict) else {}), **_ANY_REF}
    if not isinstance(schema, dict):
        return schema
    if "$id" in schema:  # a nested resource: "#/$defs/..." would resolve against its own root
        return schema
    mine = numbers and "allOf" not in schema and "$ref" not in schema
    out = _map_subschemas(schema, lambda x: _bound(x, skip, numbers and "allOf" not in schema))
    for k in ("$defs", "definitions"):
        if isinstance(schema.get(k), dict):
            out[k] = {n: schema[k][n] if f"#/{k}/{n}" in skip else v for n, v in out[k].items()}
    return _bound_free_values(_bound_number(out) if mine else out)


def _clashing_refs(schema, in_all_of: bool = False, out: set | None = None) -> set:
    """The "#/$defs/..." references made inside an allOf or beside numeric keywords."""
    out = set() if out is None else out
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and (in_all_of or any(k in schema for k in _NUMERIC)):
            out.add(ref)
        for k, v in schema.items():
            _clashing_refs(v, in_all_of or k == "allOf", out)
    elif isinstance(schema, list):
        for v in schema:
            _clashing_refs(v, in_all_of, out)
    return out


def any_value_schema() -> dict:
    """Any JSON value, its numbers bounded (refers to itself through #/$defs/ANY_VALUE)."""
    leaves = [{"type": "string"}, {"type": "boolean"}, {"type": "null"},
              _bound_number({"type": "number"}), _bound_number({"type": "integer"})]
    return {"anyOf": leaves + [{"type": "array", "items": _ANY_REF},
                               {"type": "object", "additionalProperties": _ANY_REF}]}


def bound_numbers(schema):
    """A copy of `schema` (a dict or a boolean) whose numbers are bounded in length: typed ones
    by JSON Schema bounds, free values through a bounded any-value definition added to the
    root's $defs. A schema whose root is not an object schema (true) becomes the any-value
    schema itself."""
    if _free(schema):
        schema = {**(schema if isinstance(schema, dict) else {}), **_ANY_REF}
    if not isinstance(schema, dict):
        return schema
    root_id = schema.get("$id")
    body = {k: v for k, v in schema.items() if k != "$id"}
    out = _bound(body, frozenset(_clashing_refs(body)))
    if root_id is not None:
        out["$id"] = root_id
    if _refers_to_any(out):
        out["$defs"] = {**out.get("$defs", {}), ANY_VALUE: any_value_schema()}
    return out


def _refers_to_any(schema) -> bool:
    if isinstance(schema, dict):
        return (schema.get("$ref") == _ANY_REF["$ref"]
                or any(_refers_to_any(v) for v in schema.values()))
    if isinstance(schema, list):
        return any(_refers_to_any(v) for v in schema)
    return False
