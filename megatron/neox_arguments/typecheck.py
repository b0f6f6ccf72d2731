"""Checking a YAML value against a field's annotation, with the coercions users expect.

YAML gives ints where floats are meant (`lr: 1`) and lists for tuples; those are converted. A choice may be
written in any case (`tokenizer_type: hftokenizer`), as GPT-NeoX compares choices without regard to case; it
becomes the declared spelling. Anything else that does not fit is reported with the key, the value and what
is allowed."""

import typing
from typing import Any, Literal, Tuple, Union

_NONE = type(None)


def describe(annotation: Any) -> str:
    """Human wording of an annotation for error messages."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is Union:
        parts = [describe(a) for a in args if a is not _NONE]
        text = " or ".join(parts)
        return text + (" or null" if _NONE in args else "")
    if origin in (list, typing.List):
        return f"a list of {describe(args[0])}" if args else "a list"
    if origin in (dict, typing.Dict):
        return "a dict"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if annotation is list:
        return "a list"
    if annotation is dict:
        return "a dict"
    return str(annotation)


def coerce(value: Any, annotation: Any) -> Tuple[bool, Any]:
    """Return (fits, converted value)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Union:
        if value is None:
            return _NONE in args, None
        for option in args:
            if option is _NONE:
                continue
            ok, converted = coerce(value, option)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        # compare types too, so that True does not pass for a Literal[1]
        if any(value == a and type(value) is type(a) for a in args):
            return True, value
        same_but_case = [a for a in args if isinstance(a, str) and isinstance(value, str) and a.lower() == value.lower()]
        return (True, same_but_case[0]) if len(same_but_case) == 1 else (False, value)
    if origin in (list, typing.List):
        if not isinstance(value, (list, tuple)):
            return False, value
        converted = []
        for item in value:
            ok, item = coerce(item, args[0]) if args else (True, item)
            if not ok:
                return False, value
            converted.append(item)
        return True, converted
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    if annotation is list:
        return isinstance(value, (list, tuple)), list(value) if isinstance(value, (list, tuple)) else value
    if annotation is dict:
        return isinstance(value, dict), value
    return True, value
