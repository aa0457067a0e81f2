"""PromptTemplate: f-string and sandboxed Jinja2 rendering."""

from __future__ import annotations

import sys

import pytest

import voltrl as vl


def test_f_string_and_jinja_templates_render() -> None:
    assert vl.PromptTemplate(template="Q: {q}").format(q="2+2?") == "Q: 2+2?"
    jinja = vl.PromptTemplate(
        template="{% for t in tools %}{{ t | upper }};{% endfor %} {{ q }}", engine="jinja"
    )
    assert jinja.format(tools=["calc", "search"], q="go") == "CALC;SEARCH; go"


@pytest.mark.parametrize(
    "template",
    [
        "{{ x.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ x.__class__ }}",  # jinja2's sandbox alone would render this as ""
        "{{ x | attr('__class__') }}",
        "{{ x['__class__'] }}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_jinja_templates_cannot_reach_python_internals(template: str) -> None:
    with pytest.raises(vl.PromptTemplateError, match="reaches for Python internals"):
        vl.PromptTemplate(template=template, engine="jinja").format(x="hi")


def test_a_missing_jinja2_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("jinja2", "jinja2.exceptions", "jinja2.sandbox"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    with pytest.raises(vl.PromptTemplateError, match=r"pip install 'jinja2>=3\.1'"):
        vl.PromptTemplate(template="{{ q }}", engine="jinja").format(q="x")
