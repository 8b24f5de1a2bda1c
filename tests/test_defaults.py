"""Each setting's default lives in the schema alone: the workers, the engines and the actor's
objective state none of their own (a literal default for a parameter, a dataclass field, a
``dict.get`` or an attribute named as a schema field). Static: the code is read, not run."""
from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from hybridlab.config import RunConfig

PACKAGE = Path(__file__).resolve().parents[1] / "hybridlab"
CHECKED = [*sorted((PACKAGE / "workers").rglob("*.py")), PACKAGE / "algos" / "objectives.py"]
# A generate call's parameters, as vLLM's SamplingParams has them (one sample at temperature 1 when
# a call names none); the controller sends every one from the config (StepContext.sampling).
OWN_API = {PACKAGE / "workers" / "rollout" / "sampling.py"}


def schema_fields(cls: type = RunConfig) -> set[str]:
    """Return the names of every setting (leaf field) of the config, in any section."""
    hints, out = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        out |= schema_fields(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {f.name}
    return out


def _literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value is not None  # None: "not given", the caller's value is used
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    return isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in node.elts)


def own_defaults(source: str, names: set[str]) -> list[str]:
    """Return each place in ``source`` that states a literal default for one of ``names``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
            out += [f"{node.name}({arg.arg}={ast.unparse(d)})" for arg, d in pairs
                    if d is not None and arg.arg in names and _literal(d)]
        elif isinstance(node, ast.ClassDef):
            out += [f"{node.name}.{s.target.id} = {ast.unparse(s.value)}" for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None
                    and s.target.id in names and _literal(s.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in names \
                and _literal(node.args[1]):
            out.append(ast.unparse(node))
        elif isinstance(node, ast.Assign) and _literal(node.value):
            out += [f"self.{t.attr} = {ast.unparse(node.value)}" for t in node.targets
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    and t.attr in names]
    return out


def test_no_worker_engine_or_objective_states_a_default_of_its_own():
    names = schema_fields()
    found = {str(p.relative_to(PACKAGE.parent)): d for p in CHECKED if p not in OWN_API
             if (d := own_defaults(p.read_text(), names))}
    assert found == {}, f"defaults of schema settings stated outside the schema: {found}"


def test_the_check_sees_each_way_of_stating_a_default():
    source = ("def f(model, lr=1e-5, seed=None, *, precision='fp32'): pass\n"
              "class C:\n    warmup_steps: int = 0\n    rank: int\n"
              "def g(cfg):\n    self.remove_padding = False\n    return cfg.get('kl_loss_coef', 0.001), cfg.get('x', 1)\n")
    assert own_defaults(source, {"lr", "seed", "precision", "warmup_steps", "rank", "remove_padding", "kl_loss_coef"}) \
        == ["f(lr=1e-05)", "f(precision='fp32')", "C.warmup_steps = 0", "self.remove_padding = False",
            "cfg.get('kl_loss_coef', 0.001)"]
