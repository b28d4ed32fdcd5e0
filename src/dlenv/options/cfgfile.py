"""The --cfg file: a YAML mapping of option: value, read as something a stranger may have written.

Only a regular file of at most CONFIG_FILE_LIMIT bytes is read (`dlenv.files.safeio`: a FIFO or /dev/zero is
refused at once instead of hanging or filling memory), it must be UTF-8, YAML aliases are refused
where they are composed, before anything expands, a key given twice is refused (YAML would keep the last
without a word), and a value YAML cannot build (`seed: 2001-02-30`, an int of 5,000 digits) is one line
naming its key. `dlenv.options.config.build` checks the values. No torch here: `dlenv --help` imports this module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlenv.errors import UserError

#: the largest --cfg file read: a file of options is a few KiB; /dev/zero or a 40 GB file is a mistake
CONFIG_FILE_LIMIT = 1 << 20
#: YAML values a --cfg file may hold: far above any file of options (~60), far below a bomb
YAML_NODE_LIMIT = 10_000
#: the deepest nesting of values a file of options may hold (model_args of mappings of lists, and far more)
YAML_DEPTH_LIMIT = 32


def _options_loader() -> type:
    """yaml.SafeLoader that refuses aliases (`*name`) and keys given twice, counts nodes, and names the key
    of a value it cannot build.

    A "billion laughs" file is a few hundred bytes of anchors and aliases that expand to 10^9 nodes
    when the result is walked (`epochs: *lol9`, or `model_args: *lol9` turned into text); safe_load
    itself only builds shared references, so the blow-up comes later, in our own code. No option needs
    an alias, so an alias is refused where it is composed, before anything is expanded.
    """
    import yaml

    class OptionsLoader(yaml.SafeLoader):
        nodes = 0
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(f"line {event.start_mark.line + 1}: an alias (*{event.anchor}) repeats another "
                               "value, which a file of options never needs; write each value out")
            self.nodes += 1
            if self.nodes > YAML_NODE_LIMIT:
                raise _Refused(f"line {event.start_mark.line + 1}: more than {YAML_NODE_LIMIT:,} values, far more "
                               "than a file of options holds")
            self.depth += 1
            if self.depth > YAML_DEPTH_LIMIT:  # refused where it starts, not after Python's recursion limit
                raise _Refused(f"line {event.start_mark.line + 1}: values nested more than {YAML_DEPTH_LIMIT} deep; "
                               "it nests too deeply to be a file of options")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if not isinstance(node, yaml.MappingNode):
                return super().construct_mapping(node, deep=deep)  # its own one-line YAMLError
            self.flatten_mapping(node)
            mapping: dict = {}
            lines: dict = {}
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise _Refused(f"line {line}: {_shown(key)} is given twice (first on line {lines[key]}); "
                                       "YAML would keep the last without a word: keep the one you mean")
                except TypeError:  # an unhashable key: a list or a mapping, never an option
                    raise _Refused(f"line {line}: a key that is a {type(key).__name__}, not an option name") from None
                try:
                    mapping[key] = self.construct_object(value_node, deep=True)
                except ValueError as e:  # PyYAML's own constructors: a date that is none, a number too long
                    what = _shown(value_node.value) if isinstance(value_node, yaml.ScalarNode) else "a value in it"
                    raise _Refused(f"line {value_node.start_mark.line + 1}: {_shown(key)}: YAML cannot read "
                                   f"{what} ({_shown(e)})") from None
                lines[key] = line
            return mapping

    return OptionsLoader


def _shown(value: Any, most: int = 60) -> str:
    """A key or value as a short quoted text for one line (a 5,000-digit number is cut)."""
    text = repr(str(value))
    return text if len(text) <= most else text[: most - 5] + "...'"


class _Refused(Exception):
    """A YAML file of options refused by `_options_loader`; str() says where and why."""


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of options; a bad file is a UserError naming it.

    Only a regular file of at most CONFIG_FILE_LIMIT bytes is read (`dlenv.files.safeio`: a FIFO or
    /dev/zero is refused at once instead of hanging), and aliases are refused (`_options_loader`).
    """
    return read_yaml(path)[0]


def read_yaml(path: str | Path) -> tuple[dict[str, Any], str]:
    """`load_yaml`'s mapping and the text it was read from (its comments: config.yaml's notes), one read."""
    import yaml

    from dlenv.files.safeio import read_regular

    p = Path(path)
    try:
        text = read_regular(p, CONFIG_FILE_LIMIT, what="config file").decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"config file {p} not found") from None
    except UserError as e:
        raise UserError(f"{e}, e.g. runs/exp/config.yaml") from None
    except UnicodeDecodeError as e:
        raise UserError(f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}); pass a YAML file of option: value lines, e.g. runs/exp/config.yaml"
                        ) from None
    try:
        data = yaml.load(text, Loader=_options_loader())  # noqa: S506 (a SafeLoader subclass)
    except _Refused as e:
        raise UserError(f"config file {p}, {e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {p} is not valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:  # thousands of nested brackets
        raise UserError(f"config file {p} nests too deeply to be a file of options") from None
    except ValueError as e:  # a constructor outside a mapping (the whole file one bad date)
        raise UserError(f"config file {p}: a value YAML cannot read ({_shown(e, 120)})") from None
    if data is None:
        return {}, text
    if not isinstance(data, dict):
        raise UserError(f"config file {p} must hold a mapping of option: value, not a "
                        f"{type(data).__name__}")
    return data, text


def options_in(yaml_file: str | Path, valid: set[str], train: set[str], keep: tuple[str, ...], command: str,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The options named `valid` in a --cfg file. A run's config.yaml (it holds `train`'s options, which a
    command other than train lacks) gives that command only `keep`, the rest left out in one line said
    through `say`; a key that no command has is refused with the list of valid ones."""
    data = load_yaml(yaml_file)
    names = {key: str(key).replace("-", "_") for key in data}
    counts = Counter(names.values())
    twice = [key for key in data if counts[names[key]] > 1]
    if twice:  # batch-size and batch_size: one option, and which one wins would be an accident of order
        raise UserError(f"config file {yaml_file} gives {names[twice[0]].replace('_', '-')!r} twice ("
                        f"{', '.join(repr(str(k)) for k in twice[:2])}); keep the one you mean")
    is_train = valid == train
    unknown = [key for key, name in names.items() if name not in valid and (is_train or name not in train)]
    if unknown:
        raise UserError(f"unknown option {str(unknown[0])!r} in config file {yaml_file}; valid options: "
                        f"{', '.join(sorted(f.replace('_', '-') for f in valid))}")
    if all(name in valid for name in names.values()):
        return data
    taken = {key: v for key, v in data.items() if names[key] in set(keep) & valid}
    what = (f"takes {', '.join('--' + names[k].replace('_', '-') for k in taken)} from it and leaves" if taken
            else "leaves")
    left = len(data) - len(taken)
    best = Path(yaml_file).parent / "best_model.pth"
    if "weights" in valid and best.is_file():  # the run's own folder: validate (prune, export) what it trained
        taken["weights"] = str(best)
    why = " (the run file says what it was trained on)" if "weights" in valid else ""
    say(f"config file {yaml_file} holds a training run's options: dlenv {command} {what} the other "
        f"{left} out{why}" + (f"; --weights is the run's {best}" if "weights" in taken else ""))
    return taken
