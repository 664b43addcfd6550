"""Structured output for `ctxq serve`: a JSON schema checked, compiled to a grammar by llama-cpp-python's
own converter (`llama_cpp.llama_grammar.SchemaConverter`, the port of llama.cpp's
json-schema-to-grammar.py), and the generated text checked against it with `jsonschema`.

The converter reads only some keywords and drops the rest without a word (llama_grammar.py,
`SchemaConverter.visit`), so a schema is first walked in the converter's own order of branches: a
keyword that the branch taken does not read, or reads wrongly, is refused with the keyword's name,
before anything is generated. Annotations (title, description, ...) are dropped before converting:
the converter would fail on a schema that holds only annotations, where JSON Schema means "any value".

One rule of the converter is replaced: its `char` rule (`[^"\\\\] | ...`) lets a string hold raw
control characters, which JSON forbids (RFC 8259 section 7); a small model that rambles writes a
newline inside a string with a maxLength. The replacement is llama.cpp's own later rule
(common/json-schema-to-grammar.cpp, PRIMITIVE_RULES "char").
"""

from __future__ import annotations

import json
import re

from .http_errors import reject

# kept out of the converter's view; what jsonschema checks is the schema as sent
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions"}
# string formats the converter has rules for (llama_grammar.py: "uuid" and STRING_FORMAT_RULES)
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
TYPES = {"string", "number", "integer", "boolean", "null", "object", "array"}
# JSON's string character: no `"`, no backslash, no control character U+0000-U+001F (RFC 8259 section 7);
# llama.cpp's later converter also leaves out U+007F
CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# keywords that constrain only values of one type (JSON Schema validation vocabulary, sections 6.2-6.5):
# a `type` list's branch for another type leaves them out, as a validator ignores them there
_NUMBER = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_APPLIES = {"string": {"minLength", "maxLength", "pattern", "format"}, "number": _NUMBER, "integer": _NUMBER,
            "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
                      "maxContains", "unevaluatedItems"},
            "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                       "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                       "unevaluatedProperties"}}
_TYPED = set().union(*_APPLIES.values())
_WHY = {
    "oneOf": "the converter treats it as anyOf (an output may match several); use anyOf",
    "pattern": "the converter's regular-expression rules can write quotes, backslashes and control characters "
               "unescaped, which is not JSON",
    "not": "the converter ignores it",
}


def _refuse(keyword: str, where: str, why: str | None = None):
    why = why or _WHY.get(keyword, "the grammar converter ignores it, so the output could break it")
    return reject(400, f"the schema's `{keyword}` at {where} is not supported: {why}",
                  param="response_format", code="unsupported_schema")


def _strip(schema, path: str):
    """The schema without annotations, a `type` list turned into anyOf (the converter would drop the
    type's other keywords), and refused keywords raised."""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise _refuse("type", path, "a schema must be a JSON object")
    out = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: _strip(s, f"{path}/{key}/{name}") for name, s in schema[key].items()}
    if isinstance(out.get("type"), list):
        types = out.pop("type")
        if not types or len(types) != len(set(types)):
            raise _refuse("type", path, "a type list must name distinct types")
        if "anyOf" in out or "oneOf" in out:
            raise _refuse("type", path, "a type list beside anyOf/oneOf; put the types inside the alternatives")
        branches = [{**{k: v for k, v in out.items() if k not in _TYPED or k in _APPLIES.get(t, ())}, "type": t}
                    for t in types]
        return {"anyOf": [_strip(b, f"{path}/type/{i}") for i, b in enumerate(branches)],
                **{k: out[k] for k in ("$defs", "definitions") if k in out}}
    _check(out, path)
    return out


def _literal_ok(value, where: str, keyword: str):
    # the converter writes json.dumps(value) into a grammar literal, whose escapes (\n, \\) mean the
    # characters themselves: a JSON escape other than \uXXXX would come out wrong
    if "\\" in json.dumps(value, ensure_ascii=False):
        raise _refuse(keyword, where, "a value with a backslash or a control character comes out wrong "
                                      "through the converter's literals")


def _check(s: dict, path: str) -> None:
    """Refuse what the branch of `SchemaConverter.visit` that takes `s` would ignore or get wrong;
    convert the sub-schemas it reads (in place)."""
    kind = s.get("type")
    if kind is not None and kind not in TYPES:
        raise _refuse("type", path, f"unknown type {kind!r}")
    defs = {"$defs", "definitions"}

    def only(*allowed):
        for key in s:
            if key not in allowed and key not in defs:
                raise _refuse(key, path)

    if "$ref" in s:  # visit: the reference alone
        ref = s["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise _refuse("$ref", path, "only references inside the schema (#/...) are resolved")
        return only("$ref")
    if "oneOf" in s:
        raise _refuse("oneOf", path)
    if "anyOf" in s:
        alts = s["anyOf"]
        if not isinstance(alts, list) or not alts:
            raise _refuse("anyOf", path, "it must be a non-empty list of schemas")
        s["anyOf"] = [_strip(a, f"{path}/anyOf/{i}") for i, a in enumerate(alts)]
        return only("anyOf")
    if "const" in s:
        _literal_ok(s["const"], path, "const")
        return only("const", "type")
    if "enum" in s:
        if not isinstance(s["enum"], list) or not s["enum"]:
            raise _refuse("enum", path, "it must be a non-empty list")
        for v in s["enum"]:
            _literal_ok(v, path, "enum")
        return only("enum", "type")
    extra = s.get("additionalProperties")
    if kind in (None, "object") and ("properties" in s or ("additionalProperties" in s and extra is not True)):
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise _refuse("properties", path, "it must be an object of schemas")
        for name in props:
            _literal_ok(name, path, "properties")
        s["properties"] = {n: _strip(p, f"{path}/properties/{n}") for n, p in props.items()}
        required = s.get("required", [])
        missing = [r for r in required if r not in props] if isinstance(required, list) else None
        if missing is None or missing:
            raise _refuse("required", path, f"it names {missing or required!r}, not in properties "
                                            "(the converter only writes properties it knows)")
        if isinstance(extra, dict):
            s["additionalProperties"] = _strip(extra, f"{path}/additionalProperties")
        elif extra not in (None, False, True):
            raise _refuse("additionalProperties", path, "it must be a boolean or a schema")
        return only("type", "properties", "required", "additionalProperties")
    if kind in (None, "object") and "allOf" in s:
        raise _refuse("allOf", path, "the converter merges only the properties of its parts and drops the rest")
    if kind in (None, "array") and ("items" in s or "prefixItems" in s):
        items = s.get("items")
        if "prefixItems" in s or isinstance(items, list):
            if "prefixItems" in s and items not in (None, False):
                raise _refuse("items", path, "beside prefixItems the converter reads only `items`")
            tuple_ = s.get("prefixItems") if "prefixItems" in s else items
            if not isinstance(tuple_, list) or not tuple_:
                raise _refuse("prefixItems", path, "it must be a non-empty list of schemas")
            key = "prefixItems" if "prefixItems" in s else "items"
            s[key] = [_strip(x, f"{path}/{key}/{i}") for i, x in enumerate(tuple_)]
            return only("type", key, "items")
        if not isinstance(items, dict):
            raise _refuse("items", path, "it must be a schema")
        s["items"] = _strip(items, f"{path}/items")
        _bounds(s, "minItems", "maxItems", path)
        return only("type", "items", "minItems", "maxItems")
    if kind in (None, "string") and "pattern" in s:
        raise _refuse("pattern", path)
    if kind in (None, "string") and "format" in s:
        if s["format"] not in FORMATS:
            raise _refuse("format", path, f"format {s['format']!r}: the converter has rules for "
                                          f"{', '.join(sorted(FORMATS - {'uuid1', 'uuid2', 'uuid3', 'uuid4', 'uuid5'}))}")
        return only("type", "format")
    if kind == "string":
        _bounds(s, "minLength", "maxLength", path)
        return only("type", "minLength", "maxLength")
    if kind is None and s:
        key = next(iter(k for k in s if k not in defs), None)
        if key is not None:
            raise _refuse(key, path, "a schema with it but without `type` is not converted")
    if kind == "object" and extra is True:  # any object: the converter's generic object rule
        return only("type", "additionalProperties")
    return only("type")


def _bounds(s: dict, least: str, most: str, path: str) -> None:
    # the converter would repeat a rule a negative number of times: an output that breaks the schema
    if most in s and s.get(least, 0) > s[most]:
        raise _refuse(least, path, f"{least} {s[least]} is above {most} {s[most]}: no value can match")


def compile_schema(schema) -> str:
    """The GBNF grammar of `schema` (a 400 naming the keyword it cannot honour)."""
    from llama_cpp.llama_grammar import SchemaConverter

    plain = _strip(schema, "#")
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        converter.visit(converter.resolve_refs(plain, "stdin"), "")
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as e:
        raise reject(400, f"the schema cannot be converted to a grammar ({type(e).__name__})",
                     param="response_format", code="unsupported_schema") from None
    return fix_char_rule(converter.format_grammar())


def fix_char_rule(gbnf: str) -> str:
    """The converter's grammar with JSON's string character rule (see the module's docstring)."""
    return re.sub(r"^char ::= .*$", lambda _: CHAR_RULE, gbnf, flags=re.M)


def check_schema(schema) -> None:
    """400 for a schema that is not a valid JSON Schema (Draft 2020-12, jsonschema's checker)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise reject(400, f"the schema is not valid JSON Schema: {e.message}", param="response_format",
                     code="invalid_value") from None


def mismatch(text: str, schema) -> str | None:
    """Why `text` is not a JSON document of `schema`, or None when it is."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        return f"the output is not JSON ({e.msg} at character {e.pos})"
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    return None if error is None else f"the output does not match the schema: {error.message}"
