"""Chat templates rendered as transformers renders them (transformers/utils/chat_template_utils.py): jinja2's
immutable sandbox, transformers' globals and filters, `{% generation %}`. Its own module, importing jinja2 alone,
so that a process that only renders (the gateway's template workers, serving/gateway/templates.py) starts light;
client/text.py prepares the variables (`TextModel.chat_call`)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils


class TemplateFailed(ValueError):
    """The template refused the conversation (its `raise_exception`), broke the sandbox, does not compile, or
    failed on these variables; the message says which."""


def render(source: str, variables: dict[str, Any]) -> str:
    """`source` rendered with `variables` (plain data)."""
    template = _compiled_template(source)
    try:
        return template.render(**variables)
    except jinja2.TemplateError as error:  # raise_exception, the sandbox, an undefined name
        raise TemplateFailed(str(error) or type(error).__name__) from None
    except (TypeError, ValueError, LookupError, ArithmeticError) as error:  # the template's own expressions
        raise TemplateFailed(f"the chat template failed on these messages: {error}") from None
    except RecursionError:
        raise TemplateFailed("the chat template recursed too deep") from None


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore-prefixed attributes, which could reach CPython's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]  # jinja2's own signature trick: `namespace(self=...)` still works
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


class _TemplateDict:
    """`dict` for templates: a call and `fromkeys`, no class to climb out of the sandbox through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which a prompt must keep as they are
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training
    masks): rendered as its body, so templates that use it compile."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def _compiled_template(source: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateFailed(f"the chat template does not compile: line {error.lineno}: {error.message}") from None
