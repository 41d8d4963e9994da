"""Every ``NUTP_*`` environment variable name is spelled once, in ``nemo_nutp/common/env.py``:
no other module of the package writes one as a quoted string (nor as a keyword argument, as in
``os.environ.update(NUTP_X=...)``); Python code uses the constant.

Found with ``ast`` over every ``nemo_nutp/*.py``. A *string* is a string constant, or an
f-string taken whole (its literal parts joined, so ``f"NUTP_X={v}"`` is one string). It names a
variable when ``NUTP_`` followed by a capital letter or digit occurs anywhere in it. Exempt:

* **documentation**: a string that is a statement by itself (module, class and function
  docstrings, and the strings documenting an assignment): evaluated and discarded, it only
  talks about names;
* **shell text** (the scripts ``launch/`` renders): a string with a ``$`` (a shell expansion),
  a line break (a script template) or an ``export`` statement at its start; and every string of
  a list or tuple display one of whose strings is shell text by that rule (a script assembled
  line by line: its assignments, comments and ``echo`` lines stay as the script spells them).

Comments are not strings, so they may mention names freely.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nemo_nutp"
HOME = PKG / "common" / "env.py"
NAME = re.compile(r"NUTP_[A-Z0-9]")


def _text(node: ast.expr) -> str | None:
    """The literal text of a string constant or an f-string; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values
                       if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _shell(text: str) -> bool:
    return "$" in text or "\n" in text or text.lstrip().startswith("export ")


def offenders(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string or keyword argument in ``path`` that names a ``NUTP_``
    variable and is not exempt (module docstring)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()  # ids of exempt strings and of an f-string's own literal parts
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Expr) and _text(node.value) is not None:
            skip.add(id(node.value))  # documentation
        elif isinstance(node, (ast.List, ast.Tuple)):
            texts = [t for t in map(_text, node.elts) if t is not None]
            if any(_shell(t) for t in texts):
                skip.update(id(e) for e in node.elts)  # a script built line by line
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg and NAME.match(node.arg):
            out.append((node.lineno, f"{node.arg}=..."))
            continue
        text = _text(node) if isinstance(node, ast.expr) else None
        if text is None or id(node) in skip or _shell(text) or not NAME.search(text):
            continue
        out.append((node.lineno, text))
    return sorted(out)


def test_env_names_are_spelled_only_in_common_env() -> None:
    found = [f"{p.relative_to(PKG.parent)}:{line}: {text!r}"
             for p in sorted(PKG.rglob("*.py")) if p != HOME
             for line, text in offenders(p)]
    assert not found, ("NUTP_ names quoted outside nemo_nutp/common/env.py (use its "
                       "constants):\n" + "\n".join(found))


def test_every_constant_is_its_own_nutp_name() -> None:
    from nemo_nutp.common import env

    names = {k: v for k, v in vars(env).items() if k.isupper()}
    # ours are NUTP_*; the few of Slurm's own the package reads (requeue count, node name) are
    # named here too, under a SLURM_ constant
    assert names and all(v.startswith("NUTP_") or (k.startswith("SLURM_") and
                                                   v.startswith(("SLURM_", "SLURMD_")))
                         for k, v in names.items())
    assert len(set(names.values())) == len(names)  # one constant per name
