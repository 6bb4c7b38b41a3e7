"""A request's structured-output fields -> one StructuredOutputsParams (as vLLM's server).

Three spellings reach the same constraint: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` object (sent through the
openai client's ``extra_body``), and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (+ ``guided_whitespace_pattern``). At most one of the
three may be set; errors are 400s naming the field the client sent.
"""

from __future__ import annotations

from jaxkv.structured_outputs.params import StructuredOutputsParams
from serve.errors import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def request_constraint(req) -> tuple[StructuredOutputsParams | None, str]:
    """(the constraint or None, the field it came from: "response_format",
    "structured_outputs" or a guided_* name). APIError 400 naming the field if bad."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append("response_format")
    if req.structured_outputs is not None:
        found.append("structured_outputs")
    guided = [name for name in GUIDED if getattr(req, name) is not None]
    found += guided
    if not found:
        if req.guided_whitespace_pattern is not None:
            raise APIError("guided_whitespace_pattern needs guided_json", 400, "guided_whitespace_pattern")
        return None, ""
    if len(found) > 1:
        raise APIError(f"only one structured-output constraint may be set; got {', '.join(found)}",
                       400, found[1])
    field = found[0]
    try:
        if field == "response_format":
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True), field
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError("response_format.json_schema.schema must be given for type "
                               "json_schema", 400, "response_format")
            # OpenAI's strict mode: no keys beyond the declared properties. Without it the
            # engine's default decides, which closes them too (as vLLM's default backend).
            return StructuredOutputsParams(json=rf.json_schema.json_schema,
                                           disable_additional_properties=rf.json_schema.strict or None), field
        if field == "structured_outputs":
            return StructuredOutputsParams.from_dict(req.structured_outputs), field
        return StructuredOutputsParams(**{GUIDED[field]: getattr(req, field)},
                                       whitespace_pattern=req.guided_whitespace_pattern), field
    except ValueError as e:
        raise relabel(APIError(str(e), 400, "structured_outputs"), field) from e


def relabel(err: APIError, field: str) -> APIError:
    """An error about `structured_outputs...` re-worded for the field the client sent."""
    if not field or field == "structured_outputs" or not (err.param or "").startswith("structured_outputs"):
        return err
    msg = err.message
    head, sep, rest = msg.partition(": ")
    if head.startswith("structured_outputs"):
        msg = f"{field}: {rest}" if sep else field
    return APIError(msg, err.status, field)
