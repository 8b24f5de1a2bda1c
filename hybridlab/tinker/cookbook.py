"""The Tinker cookbook's own recipes, unchanged, against a hybridlab server with no hub access.

    TINKER_API_KEY=tml-... python -m hybridlab.tinker.cookbook sl_loop \\
        base_url=http://127.0.0.1:PORT model_name=hybridlab/tiny lora_rank=8 max_steps=20

Everything after the recipe's name is the recipe's own ``chz`` config. The recipe's module
(``tinker_cookbook.recipes.sl_loop`` or ``rl_loop``) runs as published; two things it reaches
for do not exist here, and only those are replaced while it runs:

- ``datasets.load_dataset`` of its hub datasets. ``HuggingFaceH4/no_robots`` (sl_loop) and
  ``openai/gsm8k`` (rl_loop) are built from a hybridlab task (``--task``, arith by default) in
  the same columns: chat ``messages`` whose answer is ``\\boxed{N}``, as rl_loop asks for its
  answers, and ``question``/``answer`` with GSM8K's ``#### N`` final answer.
- ``model_info.get_recommended_renderer_name`` for names the cookbook's model table does not
  know (every ``hybridlab/...`` name): ``--renderer``, by default ``qwen3_instruct``, whose
  ChatML is the zoo's chat template token for token (tests/test_tinker.py checks it).

Nothing else of the cookbook is touched: its tokenizer comes from the hub cache where the server
published it (``names.py``), and the SDK it drives is the unchanged ``tinker``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import datasets
from tinker_cookbook import model_info
from tinker_cookbook.exceptions import ConfigurationError

from hybridlab.errors import UserError
from hybridlab.tasks import Sample, get_task

RECIPES = ("sl_loop", "rl_loop")
# What rl_loop appends to each question; the supervised stand-in answers in the same form.
BOXED = " Provide a numerical answer without units, written inside \\boxed{}."
DEFAULT_RENDERER = "qwen3_instruct"


def no_robots(samples: list[Sample]) -> list[dict]:
    """Return rows as ``HuggingFaceH4/no_robots`` has them: each sample's prompt and answer as
    user/assistant ``messages``, the answer written as ``\\boxed{N}``."""
    return [{"messages": [{"role": "user", "content": s.prompt + BOXED},
                          {"role": "assistant", "content": f"\\boxed{{{s.ground_truth}}}"}]} for s in samples]


def gsm8k(samples: list[Sample]) -> list[dict]:
    """Return rows as ``openai/gsm8k`` (``main``) has them: each sample's prompt as ``question``
    and its ground truth as GSM8K's ``#### N`` ``answer``."""
    return [{"question": s.prompt, "answer": f"#### {s.ground_truth}"} for s in samples]


STAND_INS: dict[str, Callable[[list[Sample]], list[dict]]] = {"HuggingFaceH4/no_robots": no_robots,
                                                              "openai/gsm8k": gsm8k}


@contextlib.contextmanager
def offline_recipe(task: str = "arith", rows: int = 256, renderer: str = DEFAULT_RENDERER,
                   seed: int = 0) -> Iterator[None]:
    """While open, the cookbook's hub datasets are the task's stand-ins (``STAND_INS``) and a
    model name its table does not know gets ``renderer``; yields nothing, restores both after."""
    get_task(task)  # an unknown task is refused here, naming the tasks, before the recipe starts
    if rows < 1:
        raise UserError(f"--rows must be at least 1, got {rows}")
    known = model_info.get_recommended_renderer_name

    def load_dataset(path: str, *args: Any, **kwargs: Any) -> datasets.DatasetDict:
        if path not in STAND_INS:
            raise UserError(f"the recipe loads {path!r} from the hub, which has no stand-in here; "
                            f"stand-ins exist for {sorted(STAND_INS)}")
        records = STAND_INS[path](get_task(task).split("train", rows, seed=seed))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(records)})

    def renderer_name(model_name: str) -> str:
        try:
            return known(model_name)
        except (KeyError, ValueError, ConfigurationError):
            return renderer

    with mock.patch.object(datasets, "load_dataset", load_dataset), \
            mock.patch.object(model_info, "get_recommended_renderer_name", renderer_name):
        yield


def run_recipe(recipe: str, config: dict[str, Any], **offline: Any) -> None:
    """Run ``tinker_cookbook.recipes.<recipe>.main`` on its ``Config(**config)`` inside
    ``offline_recipe(**offline)``; returns when the recipe does (its logs are in ``log_path``)."""
    module = _recipe_module(recipe)
    with offline_recipe(**offline):
        module.main(module.Config(**config))


def _recipe_module(recipe: str) -> Any:
    if recipe not in RECIPES:
        raise UserError(f"recipe {recipe!r} is not one this runs offline; choose one of {list(RECIPES)}")
    return importlib.import_module(f"tinker_cookbook.recipes.{recipe}")


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridlab.tinker.cookbook RECIPE [--task T] [--rows N] [--renderer R] KEY=VALUE...``:
    run the recipe offline; returns when it does."""
    import chz

    parser = argparse.ArgumentParser(prog="python -m hybridlab.tinker.cookbook", description=__doc__.split("\n")[0])
    parser.add_argument("recipe", choices=RECIPES)
    parser.add_argument("--task", default="arith", help="the hybridlab task the stand-in datasets are drawn from")
    parser.add_argument("--rows", type=int, default=256, help="rows of each stand-in dataset's train split")
    parser.add_argument("--renderer", default=DEFAULT_RENDERER,
                        help="the renderer for a model name the cookbook's table does not know")
    args, rest = parser.parse_known_args(argv)
    module = _recipe_module(args.recipe)
    with offline_recipe(args.task, args.rows, args.renderer):
        chz.nested_entrypoint(module.main, argv=rest)


if __name__ == "__main__":
    main()
