"""docs/architecture.md stays true to the code: every hook the source registers is on the map,
with the module that registers it and the callback it registers (when it is a named one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTRARS = {
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_post_accumulate_grad_hook",
    "register_hook",
    "register_prehook",
    "register_multi_grad_hook",
    "queue_callback",
    "register_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook",
    "register_load_state_dict_post_hook",
}


def _callback_name(node: ast.expr) -> str | None:
    """The name a hook is registered under: f, self.f, partial(f, ...); None for a lambda."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "partial":
        node = node.args[0]
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def registered_hooks() -> list[tuple[str, str, str | None]]:
    """(file, registrar, callback name) of every hook registration in optim/, parallel/, research/."""
    found = []
    for package in ("optim", "parallel", "research"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in REGISTRARS:
                    callback = node.args[-1] if name == "register_multi_grad_hook" else node.args[0]
                    found.append((str(path.relative_to(ROOT)), name, _callback_name(callback)))
    return found


def test_every_registered_hook_is_on_the_step_map() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    hooks = registered_hooks()
    assert len(hooks) >= 10, hooks  # the scan finds the hooks
    missing = [h for h in hooks if h[0] not in doc or (h[2] is not None and h[2] not in doc)]
    assert not missing, f"hooks not on docs/architecture.md's map (file, registrar, callback): {missing}"
