"""StructuredOutputsParams: the constraint a request's output must satisfy, and its grammar.

Names and semantics follow vLLM's ``vllm.sampling_params.StructuredOutputsParams`` with its
``guidance`` backend: exactly one of ``json`` (a JSON schema, dict or string), ``regex``,
``choice`` (a list of strings), ``grammar`` (Lark, or GBNF as llama.cpp writes it) or
``json_object=True`` (any JSON object). The grammar engine is llguidance (Microsoft's
Low-level Guidance, the library behind vLLM's ``guidance`` backend); this module only turns a
constraint into llguidance's grammar text and checks it against a tokenizer.

Bad input raises ``ValueError`` naming the field (``structured_outputs.json`` ...), before
anything is queued.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields

try:
    from llguidance.gbnf_to_lark import GbnfToLarkError as GbnfError
except ImportError:  # pragma: no cover - llguidance is a dependency
    GbnfError = ValueError

from jaxkv.structured_outputs.json_schema import bound_numbers, close_objects

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One request's output constraint (vLLM's StructuredOutputsParams).

    json: a JSON schema (dict or JSON text); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: a Lark grammar (or GBNF, as
    llama.cpp writes it); json_object: any JSON object. disable_any_whitespace: JSON without
    free whitespace between tokens (vLLM's flag; the default allows it, as vLLM's guidance
    backend); disable_additional_properties: objects of a json schema that declare
    properties and say nothing of ``additionalProperties`` get ``false`` (None, the default:
    the engine's StructuredOutputsConfig decides, which says true, as vLLM's default backend
    closes such objects; false keeps them open); whitespace_pattern: a regex for JSON
    whitespace.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # vLLM's; jaxkv has one backend, so there is no fallback

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none is" if not given else f"{len(given)} are ({', '.join(given)})"
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}; {what} set")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema must be an object, "
                                 f"got {type(value).__name__}")
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json: not JSON data ({e})"[:300]) from None
            self.json = value
        elif kind == "choice":
            if (isinstance(value, str) or not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of "
                                 f"non-empty strings, got {value!r}"[:300])
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object: must be true, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind}: must be a non-empty string, got {value!r}"[:300])
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name == "disable_additional_properties"):
                raise ValueError(f"structured_outputs.{name}: must be a bool, got {value!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern: must be a string")

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; unknown keys are refused."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs: must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if "structural_tag" in unknown:
            raise ValueError("structured_outputs.structural_tag: not supported by jaxkv (json, "
                             "regex, choice, grammar and json_object are)")
        if unknown:
            raise ValueError(f"structured_outputs: unknown field {unknown[0]!r} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**d)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """A text that equal constraints share (the grammar cache's key)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps(d, sort_keys=True)

    def to_grammar(self, bound: bool = True) -> str:
        """llguidance's grammar text (JSON) for this constraint. ValueError naming the field
        if llguidance cannot read it (an unknown schema keyword value, a bad regex...).
        bound: JSON numbers bounded in length (json_schema.bound_numbers)."""
        import llguidance

        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                schema = self.json if kind == "json" else {"type": "object"}
                if self.disable_additional_properties:
                    schema = close_objects(schema)
                if bound:
                    schema = bound_numbers(schema)
                overrides = ({"whitespace_pattern": self.whitespace_pattern}
                             if self.whitespace_pattern else None)
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), overrides=overrides,
                    defaults={"whitespace_flexible": not self.disable_any_whitespace})
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                alts = " | ".join(json.dumps(c) for c in self.choice)
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
            from llguidance.gbnf_to_lark import any_to_lark  # GBNF -> Lark; Lark kept
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.grammar))
        except (ValueError, TypeError, RuntimeError, GbnfError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_one_line(e)}") from None

    def validate(self, ll_tokenizer) -> str:
        """The grammar text, checked by llguidance against `ll_tokenizer` (an LLTokenizer):
        ValueError naming the field when it does not compile. A JSON schema whose numbers'
        bounds clash with its own (bounds in another allOf branch or beside a $ref, a range
        finer than 1e-10) compiles as the client wrote it: unbounded numbers, not a 400."""
        import llguidance

        json_kind = self.kind in ("json", "json_object")
        try:
            grammar = self.to_grammar()
            err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        except ValueError:
            if not json_kind:
                raise
            err = "the bounded schema does not compile"
        if err and json_kind:  # as written; its own errors are the client's
            grammar = self.to_grammar(bound=False)
            err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if err and self.whitespace_pattern and json_kind:
            alone = llguidance.LLMatcher.grammar_from_regex(self.whitespace_pattern)
            if llguidance.LLMatcher.validate_grammar(alone, ll_tokenizer):
                raise ValueError(f"structured_outputs.whitespace_pattern: {_one_line(err)}")
        if err:
            raise ValueError(f"structured_outputs.{self.kind}: {_one_line(err)}")
        return grammar


BACKENDS = ("auto", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (vLLM's --structured-outputs-config): the
    backend (llguidance, vLLM's "guidance"; "auto" picks it) and defaults that every request
    gets on top of its own (disable_any_whitespace; disable_additional_properties, true by
    default as vLLM's default backend (xgrammar) behaves, unless the request says false)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    disable_fallback: bool = False  # vLLM's; one backend, nothing to fall back to

    @classmethod
    def from_value(cls, value) -> StructuredOutputsConfig:
        """From None, a dict or a JSON text; ValueError naming the key."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config: must be an object, got {value!r}"[:200])
        known = {f.name for f in fields(cls)}
        for k, v in value.items():
            if k not in known:
                raise ValueError(f"structured_outputs_config.{k}: unknown key (known: "
                                 f"{', '.join(sorted(known))})")
            if k == "backend" and v not in BACKENDS:
                raise ValueError(f"structured_outputs_config.backend: must be one of {BACKENDS} "
                                 f"(jaxkv's grammar engine is llguidance), got {v!r}")
            if k != "backend" and not isinstance(v, bool):
                raise ValueError(f"structured_outputs_config.{k}: must be a bool, got {v!r}")
        return cls(**value)

    def apply(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """The request's constraint with the engine-wide defaults switched on."""
        return dataclasses.replace(
            params, disable_any_whitespace=params.disable_any_whitespace or self.disable_any_whitespace,
            disable_additional_properties=(self.disable_additional_properties
                                           if params.disable_additional_properties is None
                                           else params.disable_additional_properties))


def _one_line(e) -> str:
    """An error text on one line, at most 300 characters."""
    return " ".join(str(e).split())[:300]
