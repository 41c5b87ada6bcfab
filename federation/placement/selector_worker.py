"""The child process that evaluates CEL selectors for ``SelectorSandbox``.

It reads one request per line on stdin, ``[source, [attributes, ...]]`` as JSON, and answers one
line per device, as soon as each is done, so the parent can stop it the moment one evaluation
runs over its budget: ``[outcome, detail, cpu_s]`` where the outcome is ``value`` (detail: the
result's type, ``true`` for a true bool), ``missing`` (detail: the absent key), ``error`` or
``panic``. ``cpu_s`` is the thread's CPU time of the evaluation, which other processes on the
machine do not inflate. It imports only the CEL library, so it starts in a few tens of ms.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import cel

_MAX_MESSAGE = 200
_PROGRAMS_KEPT = 256


def _evaluate(program: Any, attributes: dict[str, Any]) -> tuple[str, str]:
    try:
        result = program.execute({"device": attributes})
    except KeyError as err:
        return "missing", str(err.args[0]) if err.args else ""
    except Exception as err:
        return "error", str(err)[:_MAX_MESSAGE]
    except BaseException as err:
        if type(err).__name__ == "PanicException":
            return "panic", ""
        raise
    if result is True:
        return "value", "true"
    return "value", type(result).__name__


def _answer(outcome: str, detail: str, cpu_s: float) -> None:
    sys.stdout.write(json.dumps([outcome, detail, cpu_s]) + "\n")
    sys.stdout.flush()


def main() -> None:
    programs: dict[str, Any] = {}
    _answer("ready", "", 0.0)
    for line in sys.stdin:
        source, attribute_sets = json.loads(line)
        program = programs.get(source)
        if program is None:
            try:
                program = cel.compile(source)
            except BaseException as err:  # compiled by the parent first: should not happen
                for _ in attribute_sets:
                    _answer("error", str(err)[:_MAX_MESSAGE], 0.0)
                continue
            if len(programs) >= _PROGRAMS_KEPT:
                programs.clear()
            programs[source] = program
        for attributes in attribute_sets:
            started = time.thread_time()
            outcome, detail = _evaluate(program, attributes)
            _answer(outcome, detail, time.thread_time() - started)


if __name__ == "__main__":
    main()
