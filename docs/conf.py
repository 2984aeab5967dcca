"""Sphinx configuration of spmd's reference documentation.

The API pages are generated here, one per public module of the package (every module
whose dotted name has no part starting with ``_``), so a new module is documented as
soon as it exists. ``spmd``'s own page documents everything in ``spmd.__all__``; a
module's page documents what the package does not already export at the top, and links
to the rest. The guide's pages are Markdown (MyST) beside this file; the outputs they
show are checked by ``tests/jobs/test_docs_outputs.py``. Build:
``sphinx-build -W --keep-going -n docs docs/_build/html``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent

import spmd  # importing spmd initialises MPI: a world of one here

project = "spmd"
author = "spmd contributors"
copyright = "spmd contributors"
release = version = spmd.__version__ if hasattr(spmd, "__version__") else ""

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.autosummary",
    "myst_parser",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "spmd"

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

nitpicky = True
# Types of other projects (no network for intersphinx in CI): named, not linked.
# Private names of spmd (a leading underscore) are named in signatures, not documented.
nitpick_ignore_regex = [
    (r"py:.*", r"(?!spmd\.)[A-Za-z_]\w*\.[\w.]+"),
    (r"py:mod", r"(?!spmd$)[A-Za-z_]\w*"),        # another project's module (pickle)
    (r"py:.*", r"spmd\.(\w+\.)*_\w+(\.\w+)*"),
    (r"py:.*", r"_\w+"),                        # a private name, from its own class's docstring
    (r"py:class", r"spmd\.(\w+\.)*[A-Z]"),       # a TypeVar (T) in a signature
    (r"py:class", r"GroupName"),  # torch's, imported for annotations only (spmd.torch)
]


def _public_modules() -> list[str]:
    """Every public module of the package, ``spmd`` first."""
    names = ["spmd"]
    for info in pkgutil.walk_packages(spmd.__path__, "spmd."):
        parts = info.name.split(".")
        if not any(p.startswith("_") for p in parts[1:]):
            names.append(info.name)
    return names


def _top_level_names() -> dict[int, str]:
    """id(object) -> the public name it is documented under: ``spmd.X`` for what
    ``spmd.__all__`` exports, else ``spmd.pkg.X`` for what a package re-exports from
    its modules (``spmd.checkpoint.Shard``); modules left out."""
    names: dict[int, str] = {}
    packages = ["spmd"] + sorted(
        (m for m in _public_modules()[1:] if hasattr(importlib.import_module(m), "__path__")),
        key=lambda m: m.count("."))
    for pkg in packages:
        module = importlib.import_module(pkg)
        for n in getattr(module, "__all__", []):
            obj = getattr(module, n)
            if not isinstance(obj, types.ModuleType):
                names.setdefault(id(obj), f"{pkg}.{n}")
    return names


def _module_page(name: str, top: dict[int, str]) -> str:
    """The MyST source of one module's API page."""
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    lines = [f"# `{name}`", ""]
    if name == "spmd":
        own = [n for n in spmd.__all__ if not isinstance(getattr(spmd, n), types.ModuleType)]
        subs = [n for n in spmd.__all__ if isinstance(getattr(spmd, n), types.ModuleType)]
        lines += ["```{eval-rst}", ".. automodule:: spmd", "   :no-members:", "```", "",
                  "Modules: " + ", ".join(f"{{py:mod}}`spmd.{s} <{getattr(spmd, s).__name__}>`"
                                          for s in subs) + ".", ""]
    else:
        if exported is None:
            lines += ["```{eval-rst}", f".. automodule:: {name}", "   :no-members:", "```"]
            return "\n".join(lines) + "\n"
        own, also = [], []
        for n in exported:
            obj = getattr(module, n)
            if isinstance(obj, types.ModuleType):
                continue
            (also if top.get(id(obj), f"{name}.{n}") != f"{name}.{n}" else own).append(n)
        parent, _, last = name.rpartition(".")
        if getattr(sys.modules[parent], last, module) is not module:
            # spmd.spawn and spmd.api.monitored_barrier: the package's function of the same
            # name is what users reach, and owns the name in the index; the module's
            # docstring is shown without declaring the module.
            doc = inspect.cleandoc(module.__doc__ or "")
            lines += ["```{eval-rst}", f".. currentmodule:: {name}", "", doc, "```", ""]
        else:
            lines += ["```{eval-rst}", f".. automodule:: {name}", "   :no-members:",
                      "```", ""]
        if also:
            links = ", ".join(f"{{py:obj}}`{top[id(getattr(module, n))]}`" for n in also)
            lines += [f"Also exported by the package, documented there: {links}.", ""]
    for n in own:
        obj = getattr(sys.modules[name], n)
        kind = ("autoclass" if inspect.isclass(obj) else
                "autofunction" if callable(obj) else "autodata")
        lines += ["```{eval-rst}", f".. {kind}:: {name}.{n}"]
        if kind == "autoclass":
            lines += ["   :members:", "   :show-inheritance:"]
        lines += ["```", ""]
    return "\n".join(lines) + "\n"


def _write_api_pages() -> None:
    """Write docs/api/ (generated, not committed): one page per public module."""
    out = HERE / "api"
    out.mkdir(exist_ok=True)
    top = _top_level_names()
    modules = _public_modules()
    pages = {m: _module_page(m, top) for m in modules}
    index = ["# API reference", "",
             "Generated from the docstrings, one page per public module.", "",
             "```{toctree}", ":maxdepth: 1", ""] + modules + ["```", ""]
    pages["index"] = "\n".join(index)
    for stale in out.glob("*.md"):
        if stale.stem not in pages:
            stale.unlink()
    for stem, text in pages.items():
        path = out / f"{stem}.md"
        # Rewrite only what changed, so incremental builds stay incremental.
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


def _drop_type_docstrings(app, what, name, obj, options, lines) -> None:
    """A constant without a docstring of its own shows none, not its type's (dict's)."""
    type_doc = type(obj).__doc__  # a slot named __doc__ makes it a descriptor, not text
    if what in ("data", "attribute") and lines and isinstance(type_doc, str) and \
            "\n".join(lines).strip() == inspect.cleandoc(type_doc).strip():
        lines.clear()


def _documented_as(module_name: str | None, target: str) -> str | None:
    """Where the object a reference names is documented, when that is not the name the
    reference uses: ``heal`` in ``spmd.runtime.heal``'s docstring is ``spmd.heal``, and
    ``MAX_HELLO`` imported into ``spmd.spawn.listener`` is ``spmd.spawn.protocol``'s."""
    for name in ([f"{module_name}.{target}"] if module_name else []) + [target]:
        mod_name, _, attr = name.rpartition(".")
        module = sys.modules.get(mod_name)
        if module is None or not hasattr(module, attr):
            continue
        obj = getattr(module, attr)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            # Classes and functions are one object each: their id names them.
            public = _TOP.get(id(obj))
            if public is None and attr in getattr(sys.modules.get(obj.__module__), "__all__", ()):
                public = f"{obj.__module__}.{attr}"
        else:
            # Data (a number, a string) is found by name in the module that exports it.
            public = next((f"{m}.{attr}" for m in _MODULES
                           if attr in getattr(sys.modules[m], "__all__", ())
                           and getattr(sys.modules[m], attr, None) is obj), None)
        if public is not None and public != name:
            return public
    return None


def _resolve_elsewhere(app, env, node, contnode):
    """Resolve a Python reference to the page that documents its object (see
    :func:`_documented_as`); None leaves it to the nitpicky warning."""
    if node.get("refdomain") != "py":
        return None
    public = _documented_as(node.get("py:module"), node["reftarget"])
    if public is None:
        return None
    return env.domains["py"].resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                          public, node, contnode)


def setup(app) -> None:
    """Hook the docstring filter and the reference resolver in."""
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    app.connect("missing-reference", _resolve_elsewhere)


_write_api_pages()
_MODULES = _public_modules()
_TOP = _top_level_names()
