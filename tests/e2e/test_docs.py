"""The documentation holds together: README.md (the front door) and the pages under docs/.

What is checked, all from the files as they are (no network, no model; a few seconds):

1. Every relative link resolves: the file (or folder) exists, and a `#anchor` is the GitHub
   slug of a heading of the target page (a page's own headings for `#anchor` alone).
2. Every docs page is reachable from README.md through links, the README links every page
   directly (its documentation map), and every page links back to README.md.
3. README.md has at most `README_MAX_LINES` lines.
4. Commands and names shown exist:
   - every `compress ...` / `runtime ...` command in a code block, or in an inline code span
     that starts with `compress ` / `runtime `, names a subcommand of the typer apps
     (`slimserve.compress.cli.app`, `slimserve.runtime.cli.app`) and uses only flags that
     subcommand accepts (`NAME="..."` shell variables of the same block are expanded);
   - every repository path (`runtime/engine/llm_engine.py`, `recipes/quickstart.yaml`,
     `tests/kernels/test_cpu_*.py`, ...) exists, globs matching at least one file;
   - every bare file name in backticks (`model_runner.py`, `cpu_attention.c`) is the name of a
     file in the repository;
   - every dotted `slimserve.<layer>...` name is a module, or a name defined at the top level of
     one (`slimserve.runtime.loading.loader.load_model`; `python -m slimserve.eval.X` included).
5. Recipe keys shown exist in the recipe schema (compress/recipe.py's pydantic models, and each
   stage's options model from compress/registry.py):
   - YAML code blocks: a block with a top-level `stages` key is a recipe (a fragment may hold
     only `stages:`); every other YAML block is a `runtime serve --config` file, whose keys
     must be serve's options (or `model` / `artifact`). A YAML block whose first line is
     `# not a recipe` is skipped (none is, today);
   - key tables (header `key | default | ...` or `` `<stage>` key | default | ...``): every code
     span of the first column is a field (`calibration.num_samples` / `seq_len` / `seed`: the undotted ones are
     siblings of the dotted one);
   - the stage table (header `stage | options | ...`): each row names a registered stage, and
     every identifier in backticks in its options column is an option of that stage, a value
     one of its options takes (a Literal's or its default) or the name of a stage.
6. Every number in the "measured" column of the README's headline results table is printed in
   the page its row links to, so a headline cannot drift from its measurement.
"""

from __future__ import annotations

import functools
import glob
import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 300

# Top-level folders of the repository whose paths the docs name (artifacts/, tune-out/... are
# outputs of commands, not repository paths).
REPO_DIRS = ("kernels", "runtime", "compress", "eval", "recipes", "tests", "docs", ".ci")
LAYERS = ("kernels", "runtime", "compress", "eval")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --------------------------------------------------------------------------------------------
# Markdown, as much of it as these pages use


@functools.cache
def parse(path: Path) -> dict:
    """Split a page into prose lines (outside fences) and fenced blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[dict] = []
    fence = None
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)", line)
        if fence is None and m:
            fence = {"marker": m.group(1), "lang": m.group(2).lower(), "line": no, "lines": []}
        elif (
            fence is not None
            and line.strip().startswith(fence["marker"])
            and not line.strip().strip("`~")
        ):
            blocks.append(fence)
            fence = None
        elif fence is not None:
            fence["lines"].append(line)
        else:
            prose.append((no, line))
    assert fence is None, f"{rel(path)}:{fence['line']}: code block never closed"
    return {"prose": prose, "blocks": blocks}


@functools.cache
def paragraphs(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of each run of non-blank prose lines: code spans and links may wrap."""
    out: list[tuple[int, str]] = []
    last = None
    for no, line in parse(path)["prose"]:
        if not line.strip():
            last = None
            continue
        if last is not None and no == last + 1:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        else:
            out.append((no, line))
        last = no
    return out


SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def strip_code_spans(text: str) -> str:
    return SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def code_spans(path: Path) -> list[tuple[int, str]]:
    """(line, content) of every inline code span; a wrapped span's line breaks become spaces."""
    return [
        (no + text.count("\n", 0, m.start()), re.sub(r"\s*\n\s*", " ", m.group(2)).strip())
        for no, text in paragraphs(path)
        for m in SPAN.finditer(text)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, everything but letters,
    digits, `_`, `-` and spaces dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links render as their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in parse(path)["prose"]:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path) -> list[tuple[int, str]]:
    return [
        (no + text.count("\n", 0, m.start()), m.group("target"))
        for no, para in paragraphs(path)
        for text in [strip_code_spans(para)]
        for m in LINK.finditer(text)
    ]


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))


def resolve(page: Path, target: str) -> tuple[Path, str]:
    file, _, anchor = target.partition("#")
    return ((page.parent / file).resolve() if file else page), anchor


# --------------------------------------------------------------------------------------------
# 1. links and anchors


def test_pages_exist():
    names = [p.name for p in pages()]
    assert "architecture.md" in names and "gpu.md" in names and len(names) >= 8, names


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_every_relative_link_and_anchor_resolves(page):
    problems = []
    for no, target in links(page):
        if is_external(target):
            continue
        file, anchor = resolve(page, target)
        if not file.exists():
            problems.append(f"{rel(page)}:{no}: {target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(
                f"{rel(page)}:{no}: {target}: no heading with anchor #{anchor} in {file.name}"
            )
    assert not problems, "\n".join(problems)


def test_slugs_follow_github():
    assert (
        slug("Tuning (`runtime tune` and `runtime serve --config`)")
        == "tuning-runtime-tune-and-runtime-serve---config"
    )
    assert slug("Layer folders and sys.path") == "layer-folders-and-syspath"
    assert slug("Real model: SmolLM2-135M-Instruct") == "real-model-smollm2-135m-instruct"
    assert (
        slug("config.json: `quantization_config` (compressed-tensors)")
        == "configjson-quantization_config-compressed-tensors"
    )


# --------------------------------------------------------------------------------------------
# 2. every page reachable from the README, and linked back


def md_links(page: Path) -> set[Path]:
    out = set()
    for _, target in links(page):
        if not is_external(target):
            file, _ = resolve(page, target)
            if file.suffix == ".md" and file.exists():
                out.add(file)
    return out


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = {README}, [README]
    while todo:
        for nxt in md_links(todo.pop()):
            if nxt not in seen and (nxt == README or nxt.parent == DOCS):
                seen.add(nxt)
                todo.append(nxt)
    unreachable = [rel(p) for p in pages() if p not in seen]
    assert not unreachable, f"not reachable from README.md: {unreachable}"


def test_readme_links_every_docs_page():
    missing = [rel(p) for p in pages()[1:] if p not in md_links(README)]
    assert not missing, f"README.md's documentation map misses {missing}"


@pytest.mark.parametrize("page", pages()[1:], ids=rel)
def test_every_docs_page_links_back_to_the_readme(page):
    assert README in md_links(page), f"{rel(page)} has no link to ../README.md"


# --------------------------------------------------------------------------------------------
# 3. the README stays a front door


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


# --------------------------------------------------------------------------------------------
# 4. commands, flags, paths and module names


@functools.cache
def cli_commands() -> dict[str, dict[str, frozenset[str]]]:
    """program -> subcommand -> the option strings it accepts (from the typer apps)."""
    import typer.main

    from slimserve.compress.cli import app as compress_app
    from slimserve.runtime.cli import app as runtime_app

    out = {}
    for prog, app in (("compress", compress_app), ("runtime", runtime_app)):
        group = typer.main.get_command(app)
        out[prog] = {
            name: frozenset(
                [
                    "--help",
                    *(
                        o
                        for p in cmd.params
                        for o in (*p.opts, *p.secondary_opts)
                        if o.startswith("-")
                    ),
                ]
            )
            for name, cmd in group.commands.items()
        }
    return out


@functools.cache
def serve_option_names() -> frozenset[str]:
    import typer.main

    from slimserve.runtime.cli import app

    serve = typer.main.get_command(app).commands["serve"]
    return frozenset(p.name for p in serve.params if p.name not in ("config", "help")) | {
        "model",
        "artifact",
    }


def shell_words(line: str) -> list[str]:
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        return list(lex)
    except ValueError:  # an unbalanced quote in an excerpt: fall back to plain words
        return line.split("#")[0].split()


def commands_in_block(lines: list[str]) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, `NAME="..."` variables
    expanded, split at `&&`, `||`, `;` and `|`, leading `VAR=value` assignments dropped."""
    joined, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            joined.append(cur + line)
            cur = ""
    if cur:
        joined.append(cur)
    env: dict[str, str] = {}
    out = []
    for line in joined:
        text = line.strip()
        if text.startswith("$ "):
            text = text[2:]
        m = re.match(r"^([A-Za-z_]\w*)=(\"[^\"]*\"|'[^']*'|\S*)\s*$", text)
        if m:
            env[m.group(1)] = m.group(2).strip("\"'")
            continue
        for name, value in env.items():
            text = re.sub(r"\$\{?" + name + r"\b\}?", lambda _m, v=value: v, text)
        words, simple = shell_words(text), []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|", "&", ";;"):
                while simple and re.match(r"^[A-Za-z_]\w*=", simple[0]):
                    simple.pop(0)
                if simple:
                    out.append(simple)
                simple = []
            else:
                simple.append(w)
    return out


def shown_commands() -> list[tuple[str, list[str]]]:
    """(where, words) of every `compress` / `runtime` command in code blocks and code spans."""
    found = []
    for page in pages():
        for block in parse(page)["blocks"]:
            if block["lang"] in ("python", "py", "yaml", "yml", "json"):
                continue
            for words in commands_in_block(block["lines"]):
                if words[0] in ("compress", "runtime"):
                    found.append((f"{rel(page)}:{block['line']} (code block)", words))
        for no, span in code_spans(page):
            words = commands_in_block([span.replace("|", "/")])  # `a|b` in a span: alternatives
            if words and words[0][0] in ("compress", "runtime") and len(words[0]) > 1:
                found.append((f"{rel(page)}:{no}", words[0]))
    return found


FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")


def test_shown_commands_exist_with_their_flags():
    cli = cli_commands()
    found = shown_commands()
    assert len(found) >= 40, f"only {len(found)} commands found: the extraction broke"
    problems = []
    for where, words in found:
        prog, sub, rest = words[0], words[1], words[2:]
        if sub.startswith("-"):  # `compress --help`: the group's own options
            if sub != "--help":
                problems.append(f"{where}: `{prog}` has no option {sub}")
            continue
        subs = sub.split("/")  # `runtime serve/generate/bench`: several subcommands at once
        unknown = [s for s in subs if s not in cli[prog]]
        if unknown:
            problems.append(
                f"{where}: `{prog} {sub}`: no subcommand {unknown} (has {sorted(cli[prog])})"
            )
            continue
        for s in subs:
            for word in rest:
                if word.startswith(("'", '"')) or " " in word:
                    continue  # a quoted value (a prompt), never a flag
                for flag in FLAG.findall(word.split("=", 1)[0] if word.startswith("-") else word):
                    if flag not in cli[prog][s]:
                        problems.append(f"{where}: `{prog} {s}` has no option {flag}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_command_extraction_sees_continuations_variables_and_chains():
    block = [
        'W="--num-prompts 48 --device cpu"',
        "runtime bench recipes/demo-model $W --request-rate 3 \\",
        "    --profile   # a comment --not-a-flag",
        "pip install -e . && compress run recipes/quickstart.yaml",
        "RAY_ADDRESS=auto runtime serve MODEL -tp 8",
    ]
    assert commands_in_block(block) == [
        [
            "runtime",
            "bench",
            "recipes/demo-model",
            "--num-prompts",
            "48",
            "--device",
            "cpu",
            "--request-rate",
            "3",
            "--profile",
        ],
        ["pip", "install", "-e", "."],
        ["compress", "run", "recipes/quickstart.yaml"],
        ["runtime", "serve", "MODEL", "-tp", "8"],
    ]


# Flags of other programs the docs show (pip, ray, git); anything else must be ours.
OTHER_TOOLS_FLAGS = frozenset(
    {"--index-url", "--no-deps", "--head", "--address", "--node-ip-address", "--follow"}
)
LONG_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][A-Za-z0-9-]*)")


def module_file(dotted: str) -> Path | None:
    """The source file of `slimserve.<dotted>` (a module, or a package's __main__/__init__)."""
    path = REPO.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__main__.py", path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def flag_literals(source: Path) -> set[str]:
    return set(re.findall(r"[\"'](--[A-Za-z][\w-]*)", source.read_text(encoding="utf-8")))


@functools.cache
def module_flags(dotted: str) -> frozenset[str]:
    """The `--flags` a `python -m slimserve.<dotted>` module defines: string literals in its file
    and in the slimserve modules it imports (argparse options often live in a shared helper)."""
    source = module_file(dotted)
    flags = flag_literals(source)
    for imported in re.findall(
        r"^\s*from slimserve\.([\w.]+) import", source.read_text(encoding="utf-8"), re.M
    ):
        dep = module_file(imported)
        if dep is not None:
            flags |= flag_literals(dep)
    return frozenset(flags | {"--help"})


def python_m_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, arguments) of every `python -m slimserve.X ...` shown."""
    found = []
    for page in pages():
        candidates = [
            (f"{rel(page)}:{b['line']} (code block)", words)
            for b in parse(page)["blocks"]
            if b["lang"] not in ("python", "py", "yaml", "yml", "json")
            for words in commands_in_block(b["lines"])
        ]
        candidates += [
            (f"{rel(page)}:{no}", words)
            for no, span in code_spans(page)
            for words in commands_in_block([span.replace("|", "/")])
        ]
        for where, words in candidates:
            if (
                len(words) >= 3
                and words[0] in ("python", "python3")
                and words[1] == "-m"
                and re.fullmatch(r"slimserve(\.\w+)+", words[2])
            ):  # not `slimserve...`
                found.append((where, words[2].removeprefix("slimserve."), words[3:]))
    return found


def test_python_m_commands_use_modules_and_flags_that_exist():
    found = python_m_commands()
    assert len(found) >= 15, (
        f"only {len(found)} `python -m slimserve...` commands found: the extraction broke"
    )
    problems = []
    for where, module, args in found:
        if module_file(module) is None:
            problems.append(f"{where}: no module slimserve.{module}")
            continue
        for word in args:
            if word.startswith(("'", '"')) or " " in word:
                continue
            for flag in LONG_FLAG.findall(word.split("=", 1)[0]):
                if flag not in module_flags(module):
                    problems.append(f"{where}: slimserve.{module} defines no option {flag}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_every_flag_named_in_code_exists():
    """A `--flag` in any code span (prose, tables) is an option of a `compress`/`runtime`
    subcommand, of a `python -m slimserve.eval...` module, or of another program the docs show."""
    known = set(OTHER_TOOLS_FLAGS)
    for subcommands in cli_commands().values():
        for flags in subcommands.values():
            known |= flags
    for source in (REPO / "eval").rglob("*.py"):
        known |= flag_literals(source)
    problems, n = [], 0
    for page in pages():
        for no, span in code_spans(page):
            for m in LONG_FLAG.finditer(span):
                flag, n = m.group(1), n + 1
                if span[m.end() : m.end() + 1] == "*" or flag.endswith("-"):  # `--input-len-*`
                    ok = any(k.startswith(flag) for k in known)
                else:
                    ok = flag in known
                if not ok:
                    problems.append(
                        f"{rel(page)}:{no}: {flag} is no option of ours (nor a listed other tool's)"
                    )
    assert n >= 150, f"only {n} flags found: the extraction broke"
    assert not problems, "\n".join(sorted(set(problems)))


PATH = re.compile(
    r"(?<![\w./~$<>-])((?:" + "|".join(re.escape(d) for d in REPO_DIRS) + r")/[\w./*{},-]*)"
)


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        x
        for alt in m.group(1).split(",")
        for x in expand_braces(path[: m.start()] + alt + path[m.end() :])
    ]


def mentioned_paths(page: Path) -> list[tuple[int, str]]:
    text_lines = list(parse(page)["prose"])
    for block in parse(page)["blocks"]:
        text_lines += [(block["line"], line) for line in block["lines"]]
    out = []
    for no, line in text_lines:
        line = LINK.sub(lambda m: m.group("text"), line)  # link targets are checked as links
        for m in PATH.finditer(line):
            out.append((no, m.group(1).rstrip(".,;:")))
    return out


def test_repository_paths_named_exist():
    problems, n = [], 0
    for page in pages():
        for no, path in mentioned_paths(page):
            n += 1
            for p in expand_braces(path):
                if not glob.glob(str(REPO / p)):
                    problems.append(f"{rel(page)}:{no}: {p} does not exist")
    assert n >= 100, f"only {n} paths found: the extraction broke"
    assert not problems, "\n".join(problems)


@functools.cache
def repo_file_names() -> frozenset[str]:
    names = set()
    for d in (*REPO_DIRS, "."):
        root = REPO / d
        files = root.rglob("*") if d != "." else root.glob("*")
        names.update(p.name for p in files if p.is_file() and ".venv" not in p.parts)
    return frozenset(names)


def test_bare_source_file_names_exist():
    problems = []
    for page in pages():
        for no, span in code_spans(page):
            for name in re.findall(r"^([\w-]+\.(?:py|c))$", span):
                if name not in repo_file_names():
                    problems.append(f"{rel(page)}:{no}: `{name}` is no file of the repository")
    assert not problems, "\n".join(problems)


DOTTED = re.compile(r"\bslimserve\.((?:" + "|".join(LAYERS) + r")(?:\.\w+)*)")


def top_level_names(source: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def dotted_name_problem(dotted: str) -> str | None:
    parts = dotted.split(".")
    path = REPO / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            rest = parts[i + 1 :]
            if rest and rest[0] not in top_level_names(path / f"{part}.py"):
                return f"{rest[0]} is not defined in {rel(path / f'{part}.py')}"
            return None
        else:
            return f"no module or package {part} in {rel(path)}"
    return None


def test_dotted_slimserve_names_exist():
    problems, n = [], 0
    for page in pages():
        text = page.read_text(encoding="utf-8").splitlines()
        for no, line in enumerate(text, 1):
            for m in DOTTED.finditer(line):
                n += 1
                why = dotted_name_problem(m.group(1))
                if why:
                    problems.append(f"{rel(page)}:{no}: slimserve.{m.group(1)}: {why}")
    assert n >= 20, f"only {n} names found: the extraction broke"
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# 5. recipe keys


def model_fields(model) -> dict[str, typing.Any]:
    return {name: f.annotation for name, f in model.model_fields.items()}


def nested_model(annotation):
    """The pydantic model an annotation holds (directly, in a union or a container), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = nested_model(arg)
        if found is not None:
            return found
    return None


def literal_values(annotation) -> set[str]:
    out = set()
    if typing.get_origin(annotation) is typing.Literal:
        out.update(str(v) for v in typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        if typing.get_origin(annotation) is not typing.Literal:
            out |= literal_values(arg)
    return out


def stages() -> dict:
    from slimserve.compress.registry import STAGE_SPECS

    return STAGE_SPECS


def recipe_model():
    from slimserve.compress.recipe import RecipeModel

    return RecipeModel


def check_mapping(data, model, where: str) -> list[str]:
    """Unknown keys of `data` against pydantic `model`, recursively."""
    if not isinstance(data, dict):
        return []
    fields = model_fields(model)
    problems = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{where}: unknown key {key!r} (known: {sorted(fields)})")
            continue
        sub = nested_model(fields[key])
        if sub is None:
            continue
        if free_keys(fields[key]) and isinstance(value, dict):  # dict[str, Model]: any keys
            for k, v in value.items():
                problems += check_mapping(v, sub, f"{where}.{key}.{k}")
        else:
            problems += check_mapping(value, sub, f"{where}.{key}")
    return problems


def free_keys(annotation) -> bool:
    """Whether an annotation is (or holds in a union) a dict whose keys the user names."""
    if typing.get_origin(annotation) is dict:
        return True
    return any(free_keys(a) for a in typing.get_args(annotation))


def check_recipe(data: dict, where: str) -> list[str]:
    problems = check_mapping(
        {k: v for k, v in data.items() if k != "stages"}, recipe_model(), where
    )
    for i, entry in enumerate(data.get("stages") or []):
        if not (isinstance(entry, dict) and len(entry) == 1):
            problems.append(f"{where}: stages[{i}] is not one {{stage: options}} mapping")
            continue
        ((name, options),) = entry.items()
        if name not in stages():
            problems.append(
                f"{where}: stages[{i}]: no stage {name!r} (registered: {sorted(stages())})"
            )
            continue
        problems += check_mapping(options or {}, stages()[name], f"{where}: stages[{i}].{name}")
    return problems


def yaml_blocks() -> list[tuple[str, list[str]]]:
    return [
        (f"{rel(page)}:{b['line']}", b["lines"])
        for page in pages()
        for b in parse(page)["blocks"]
        if b["lang"] in ("yaml", "yml")
    ]


def test_yaml_blocks_use_keys_that_exist():
    blocks = yaml_blocks()
    assert len(blocks) >= 3, "the recipe and --config examples went missing"
    problems = []
    for where, lines in blocks:
        if lines and lines[0].strip() == "# not a recipe":
            continue
        data = yaml.safe_load("\n".join(lines))
        assert isinstance(data, dict), f"{where}: a YAML block that is no mapping"
        # a recipe, or a part of one: its stages, or a key only recipes have (`gate:` ...)
        recipe_only = set(recipe_model().model_fields) - serve_option_names()
        if "stages" in data or set(data) & recipe_only:
            problems += check_recipe(data, where)
        else:
            unknown = {k.replace("-", "_").lstrip("_") for k in data} - serve_option_names()
            if unknown:
                problems.append(
                    f"{where}: a `runtime serve --config` file with unknown keys {sorted(unknown)}"
                )
    assert not problems, "\n".join(problems)


def tables(page: Path):
    """(line, header cells, rows of cells) of every pipe table outside code blocks."""
    rows: list[tuple[int, str]] = []
    out = []
    for no, line in [*parse(page)["prose"], (10**9, "")]:
        if line.lstrip().startswith("|"):
            rows.append((no, line.strip()))
            continue
        if len(rows) >= 2 and re.match(r"^\|[\s:|-]+\|$", rows[1][1]):
            cells = [[c.strip() for c in re.split(r"(?<!\\)\|", r.strip("|"))] for _, r in rows]
            out.append((rows[0][0], cells[0], cells[2:]))
        rows = []
    return out


def field_of(model, dotted: str):
    """The annotation at a dotted key of `model`, or None when a part does not exist."""
    annotation = None
    for part in dotted.split("."):
        if model is None or part not in model_fields(model):
            return None
        annotation = model_fields(model)[part]
        model = nested_model(annotation)
    return annotation if annotation is not None else False


def test_key_tables_name_fields_that_exist():
    problems, n = [], 0
    for page in pages():
        for no, header, rows in tables(page):
            m = re.fullmatch(r"(?:`(\w+)` )?key", header[0])
            if not m or header[1:2] != ["default"]:
                continue
            model = recipe_model() if m.group(1) is None else stages().get(m.group(1))
            assert model is not None, (
                f"{rel(page)}:{no}: a key table of stage {m.group(1)!r}, which is not registered"
            )
            for row in rows:
                parent = ""
                for key in re.findall(r"`([^`]+)`", row[0]):
                    n += 1
                    full = key if "." in key else (f"{parent}.{key}" if parent else key)
                    if "." in key:
                        parent = key.rsplit(".", 1)[0]
                    if field_of(model, full) is None:
                        problems.append(f"{rel(page)}:{no}: `{full}` is no key of {model.__name__}")
    assert n >= 40, f"only {n} keys found in key tables: the extraction broke"
    assert not problems, "\n".join(problems)


def test_stage_table_names_options_that_exist():
    problems, n = [], 0
    for page in pages():
        for no, header, rows in tables(page):
            if header[:2] != ["stage", "options"]:
                continue
            for row in rows:
                name = row[0].strip("`")
                if name not in stages():
                    problems.append(f"{rel(page)}:{no}: no stage {name!r}")
                    continue
                fields = model_fields(stages()[name])
                allowed = set(fields) | set(stages()) | {"null", "true", "false"}
                for field, annotation in fields.items():
                    allowed |= literal_values(annotation) | {
                        str(stages()[name].model_fields[field].default)
                    }
                for word in re.findall(r"`([A-Za-z_][\w]*)`", row[1]):
                    n += 1
                    if word not in allowed:
                        problems.append(
                            f"{rel(page)}:{no}: `{word}` is no option (or option value) of {name}"
                        )
    assert n >= 40, f"only {n} options found in the stage table: the extraction broke"
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# 6. the README's headline numbers are the measured ones


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def test_headline_numbers_are_printed_where_they_were_measured():
    found = [t for t in tables(README) if t[1][:2] == ["result", "measured"]]
    assert len(found) == 1, (
        "README.md has no headline results table (header `result | measured | ...`)"
    )
    no, _, rows = found[0]
    assert len(rows) >= 5
    problems = []
    for row in rows:
        targets = [m.group("target") for m in LINK.finditer(row[2])]
        assert targets, f"README.md:{no}: headline row {row[0]!r} links no page"
        texts = ""
        for target in targets:
            file, _ = resolve(README, target)
            texts += file.read_text(encoding="utf-8") + "\n"
        for num in NUMBER.findall(row[1]):
            if not re.search(r"(?<![\d.,])" + re.escape(num) + r"(?![\d]|[.,]\d)", texts):
                problems.append(f"README.md headline {row[0]!r}: {num} is not printed in {targets}")
    assert not problems, "\n".join(problems)
