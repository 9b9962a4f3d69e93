#!/usr/bin/env python3
"""docs/ENVIRONMENT.md, generated from the code, and the check that keeps the two together.

    scripts/dev/env_reference.py           check; exit 1 listing every problem
    scripts/dev/env_reference.py --write   regenerate docs/ENVIRONMENT.md
    --root DIR                             another checkout (the tests use small fake ones)

Where the page's facts come from:
- the meaning of each variable the library reads: src/core/env.cc's kVariables table, the same
  table that unknown_loom_variables() uses to call other LOOM_* names typos;
- each variable's group, type, range and default, and the meaning of the variables that only
  tools, tests and scripts read: GROUPS below (env.cc's table holds names and meanings only);
- who reads each variable, and the NCCL_* (and other multicast) switches that loom sets: a scan
  of the sources (SCANNED_DIRS).

The check fails when a LOOM_* variable is read in the sources but GROUPS lacks it, or GROUPS
documents one that nothing reads; when the library reads a LOOM_* variable that kVariables lacks,
or kVariables lists one that nothing in src/ reads; when a reader's range, default or choices
differ from GROUPS; and when the committed page is not what --write produces.
"""

import argparse
import ast
import operator
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PAGE = "docs/ENVIRONMENT.md"
ENV_CC = "src/core/env.cc"
SCANNED_DIRS = ("src", "tools", "python", "tests", "scripts", "bench", "examples")
SKIPPED_DIRS = ("bench/results",)  # logs of past runs quote variables; they read none
SUFFIXES = {".cc", ".cu", ".h", ".cuh", ".cpp", ".hpp", ".py", ".sh"}
DAY_MS = 24 * 3600 * 1000
# Switches loom's programs and scripts set for the libraries beside it (NCCL, torch, NVSHMEM).
FOREIGN_SWITCH = r"(?:NCCL|NVSHMEM|TORCH_SYMM_MEM)_[A-Z0-9_]+"


@dataclass(frozen=True)
class Var:
    """One documented variable. Ranges, numeric defaults and choices are checked against every
    reader call in the code that passes them (READER_ARGUMENTS)."""

    name: str
    kind: str                  # integer, bytes, decimal, choice or text
    default: object = None     # the fallback readers pass (checked), or None: default_text says it
    default_text: str = ""
    lo: float | None = None    # integer, bytes, decimal: the accepted range
    hi: float | None = None
    unit: str = ""
    choices: tuple = ()
    text_type: str = ""        # text: what the value is
    meaning: str = ""          # only for variables kVariables lacks
    note: str = ""
    # path -> (lo, hi): a reader that accepts another range; the page says so.
    other_ranges: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    title: str
    intro: str
    variables: tuple
    reader_files: bool = True  # name the files of test and script readers, not only the component


GROUPS = (
    Group("Bootstrap and security",
          "How the ranks of a job find rank 0 and prove they belong to the job (docs/SECURITY.md). "
          "`LOOM_SECRET` and `LOOM_BOOTSTRAP_PORT` are read only by a communicator created from the "
          "environment (`Communicator::from_env`, `loom.Communicator.from_env`), before anything "
          "else; one from a unique id carries its own address and secret.",
          (
              Var("LOOM_SECRET", "text", text_type="32 hexadecimal digits (surrounding blanks ignored)",
                  default_text="none: required when WORLD_SIZE > 1",
                  note="`loom-run` and `loom-bench --spawn` set a fresh random one in every rank. A bad value is "
                       "reported without its text. Under torchrun, `loom.Communicator.from_env()` uses the torch "
                       "process group instead when torch.distributed is initialised; with neither, it refuses a "
                       "job of several ranks itself."),
              Var("LOOM_BOOTSTRAP_PORT", "integer", lo=1, hi=65535,
                  default_text="MASTER_PORT; MASTER_PORT + 1 under torchrun (TORCHELASTIC_RUN_ID set)",
                  note="Read only where MASTER_PORT is: jobs of several ranks, or MASTER_PORT set."),
              Var("LOOM_BOOTSTRAP_TIMEOUT_MS", "integer", default=120_000, lo=1, hi=DAY_MS, unit="ms",
                  note="A non-zero `CommOptions::bootstrap_timeout` (Python: `bootstrap_timeout_ms`) overrides it. "
                       "It also bounds the other host-side collective steps (heap and network setup). "
                       "scripts/device/ sets 60000 unless it is already set."),
          )),
    Group("Runtime",
          "The symmetric heap, the deadline of every wait, and the planners' inputs. Parsed when a "
          "communicator is created unless noted.",
          (
              Var("LOOM_TIMEOUT_MS", "integer", default=30_000, lo=1, hi=DAY_MS, unit="ms",
                  note="A non-zero `CommOptions::op_timeout` (Python: `op_timeout_ms`) overrides it. "
                       "scripts/device/ sets 20000 unless it is already set. The standalone `loom::gemm` reads "
                       "it itself, at its first call on each device, with the same range."),
              Var("LOOM_HEAP_BYTES", "bytes", default=1 << 30, lo=1 << 20, hi=1 << 40,
                  note="A non-zero `CommOptions::heap_bytes` (Python: `heap_bytes`) overrides it. Every rank "
                       "must ask for the same size (creation fails naming the rank that differs)."),
              Var("LOOM_HEAP_BACKEND", "choice", default="auto", choices=("auto", "vmm", "ipc"),
                  note="auto picks vmm when every GPU of the node exports cuMem allocations as POSIX file "
                       "descriptors, else ipc. Every rank must use the same setting."),
              Var("LOOM_COLL_CTAS", "integer", default=0, lo=0, hi=4096,
                  note="A non-zero `CollectiveOptions::num_ctas` overrides it for one call."),
              Var("LOOM_TUNING_CACHE", "text", text_type="path of a JSON file",
                  default_text="unset: the cost model plans",
                  note="Read by the fused operators at each launch; each path is loaded once per process. A "
                       "missing file is an empty cache (with a warning); a malformed file or an empty value is "
                       "an error. Every rank must use the same cache, or the planners may disagree. "
                       "`loom-bench tune` unsets it while it tunes."),
          )),
    Group("Network and proxy",
          "The path to ranks on other (real or emulated) nodes: the transport, and the proxy threads "
          "that post the GPU's commands to it (docs/NETWORK.md). Parsed when every communicator is "
          "created, also on one node.",
          (
              Var("LOOM_TRANSPORT", "choice", default="auto", choices=("auto", "copy_engine", "fabric", "verbs"),
                  note="auto: copy_engine when every cross-node peer runs on this host (emulated nodes), else "
                       "verbs, else fabric. A forced transport that cannot reach the peers fails creation."),
              Var("LOOM_PROXY_THREADS", "integer", default=1, lo=1, hi=64),
              Var("LOOM_NET_DEVICE", "text", text_type="verbs device or libfabric domain name (not empty)",
                  default_text="unset: the first usable"),
              Var("LOOM_FABRIC_PROVIDER", "text", text_type="libfabric provider name (not empty)",
                  default_text="unset: the first of efa, verbs, tcp that offers RMA"),
              Var("LOOM_IB_GID_INDEX", "integer", default=0, lo=0, hi=255),
          )),
    Group("Shared GPU and emulation",
          "Correctness runs of multi-GPU and multi-node code paths on fewer GPUs than they need "
          "(docs/ARCHITECTURE.md). They time nothing meaningful.",
          (
              Var("LOOM_RANKS_PER_GPU", "integer", default=1, lo=1, hi=64,
                  note="`loom-run --ranks-per-gpu K` sets it in every rank; `loom-bench` refuses to run with it "
                       "above 1; `Communicator.ranks_per_gpu` reports it in Python. A non-zero "
                       "`CommOptions::ranks_per_gpu` overrides it. Every rank must use the same value."),
              Var("LOOM_EMULATE_NODES", "integer", default=1, lo=1, hi=64,
                  note="Must divide the ranks of each host. `loom-bench multinode` also reads it, unchecked, to "
                       "size the heap before the communicator checks it."),
              Var("LOOM_EMULATE_NET_GBPS", "decimal", default=0, lo=0.0, hi=100000.0, unit="GB/s",
                  note="Shared evenly by the LOOM_PROXY_THREADS lanes, so together they emulate one link."),
              Var("LOOM_EMULATE_NET_LAT_US", "decimal", default=0, lo=0.0, hi=1e7, unit="us"),
          )),
    Group("Logging",
          "",
          (
              Var("LOOM_LOG", "choice", default="warn", choices=("error", "warn", "warning", "info", "debug", "trace"),
                  note="Read at the first log line of the process (a bad value is reported on stderr and "
                       "logging stays at warn) and again when a communicator is created (a bad or empty value "
                       "fails the creation). `warning` is accepted for `warn`."),
          )),
    Group("Tests only",
          "Read by loom's test programs, never by the library.",
          (
              Var("LOOM_TEST_FUZZ_SEED", "integer", default=20261107, lo=0, hi=(1 << 64) - 1,
                  meaning="seed of the proxy's command fuzz test (ProxyFuzz); CI uses the default",
                  note="Parsed with strtoull: not checked."),
              Var("LOOM_TEST_HEAP_BYTES", "integer", lo=0, hi=(1 << 64) - 1, unit="bytes",
                  default_text="4 GiB + 1 GiB x world size",
                  meaning="symmetric heap of the GPU tests' shared communicator",
                  note="Parsed with strtoull (no K/M/G suffix): not checked."),
              Var("LOOM_TEST_STRESS_LAUNCHES", "integer", lo=2, hi=100000, default_text="50",
                  meaning="back-to-back launches of each operator in MultiNodeStress (shared_gpu_suite.sh sets 500)"),
              Var("LOOM_TEST_MOE_LAUNCHES", "integer", lo=1, hi=100000, default_text="100",
                  meaning="back-to-back launches of routing, dispatch and combine in MoeStress",
                  note="Parsed with atoi; values below 1 count as 1."),
              Var("LOOM_TEST_FAULT", "text", text_type="`kill:<op>`, `stop:<op>`, `before_join:<how>:<rank>`, `two_comms`",
                  default_text="unset: FaultChild.Run skips",
                  meaning="set by the Fault* GPU tests (tests/gpu/fault_test.cu) in the ranks of the jobs they start: "
                          "the scenario FaultChild.Run plays; also lets such a rank start without a GPU"),
              Var("LOOM_TEST_JUNIT_DIR", "text", text_type="directory", default_text="unset: no per-rank files",
                  meaning="every rank of a torchrun pytest job writes its JUnit XML to DIR/rank<RANK>.xml, unless "
                          "--junitxml is given (scripts/device/shared_gpu_suite.sh sets it)"),
              Var("LOOM_TEST_PY_OVERHEAD_JSON", "text", text_type="file path", default_text="unset: not written",
                  meaning="where the Python launch-overhead test writes its measurements "
                          "(scripts/device/python_suite.sh sets it)"),
          )),
    Group("Build and test scripts",
          "Read by shell scripts, never by the library.",
          (
              Var("LOOM_TEST_BUILD_DIR", "text", text_type="directory", default_text="build",
                  meaning="the configured build tree scripts/ci_consumer.sh installs and builds the consumer "
                          "example against"),
              Var("LOOM_TEST_PIP_PREBUILT", "text", text_type="`1` (anything else: off)", default_text="0",
                  meaning="1: scripts/test.sh builds only the Python extension, against build/libloom.so, "
                          "instead of the whole package"),
          )),
    Group("Launch variables (not LOOM_*)",
          "The torchrun and Slurm-style variables: a communicator created from the environment reads "
          "them all, every other communicator LOCAL_RANK and LOCAL_WORLD_SIZE. `loom-run` sets all but "
          "TORCHELASTIC_RUN_ID (and LOOM_SECRET) in every rank.",
          (
              Var("WORLD_SIZE", "integer", lo=1, hi=1 << 20, default_text="required",
                  meaning="ranks in the job"),
              Var("RANK", "integer", lo=0, hi=(1 << 20) - 1, default_text="required",
                  meaning="this rank, below WORLD_SIZE"),
              Var("MASTER_ADDR", "text", text_type="host name or address", default_text="required when WORLD_SIZE > 1",
                  meaning="where rank 0's bootstrap listens"),
              Var("MASTER_PORT", "integer", lo=1, hi=65535, default_text="required when WORLD_SIZE > 1",
                  meaning="rank 0's port (see LOOM_BOOTSTRAP_PORT)"),
              Var("LOCAL_RANK", "integer", lo=0, hi=1 << 20, default_text="unset: rank % visible GPUs picks the GPU",
                  meaning="this rank's index on its host: its GPU, unless `CommOptions::device` names one"),
              Var("LOCAL_WORLD_SIZE", "integer", lo=1, hi=1 << 20, default_text="unset: not checked",
                  meaning="ranks on this host; checked against the ranks that really share it"),
              Var("TORCHELASTIC_RUN_ID", "text", text_type="any", default_text="unset: not under torchrun",
                  meaning="set by torchrun: rank 0 then listens on MASTER_PORT + 1, torch's store having MASTER_PORT"),
          ),
          reader_files=False),
)

# ---- reading the code ---------------------------------------------------------------------------

NAME = r"([A-Z][A-Z0-9_]*)"
READ_PATTERNS = {
    "cxx": [re.compile(r"\b(?:getenv|get_raw|get_int|get_bytes|get_bool|get_choice|required_int)\(\s*\"" + NAME + '"')],
    "py": [re.compile(r"\bos\.environ\.get\(\s*[\"']" + NAME + "[\"']"),
           re.compile(r"\bos\.getenv\(\s*[\"']" + NAME + "[\"']"),
           re.compile(r"[\"']" + NAME + r"[\"']\s+(?:not\s+)?in\s+os\.environ\b"),
           re.compile(r"\bos\.environ\[\s*[\"']" + NAME + r"[\"']\s*\](?!\s*=[^=])")],
    "sh": [re.compile(r"\$\{?" + NAME)],
}
SET_PATTERNS = {
    "cxx": re.compile(r"\bsetenv\(\s*\"(" + FOREIGN_SWITCH + r")\"\s*,\s*\"([^\"]*)\""),
    "py": re.compile(r"\bos\.environ\[\s*[\"'](" + FOREIGN_SWITCH + r")[\"']\s*\]\s*=\s*[\"']([^\"']*)[\"']"),
    "sh": re.compile(r"(?<![\w$])(" + FOREIGN_SWITCH + r")=([^\s;]+)"),
}
# Readers whose arguments carry a range or choices, by the arguments that follow the name.
READER_ARGUMENTS = {"get_int": ("fallback", "lo", "hi"), "get_bytes": ("fallback", "lo", "hi"),
                    "parse_int": ("text", "lo", "hi"), "parse_bytes": ("text", "lo", "hi"),
                    "parse_decimal": ("text", "lo", "hi"), "required_int": ("lo", "hi"),
                    "get_choice": ("fallback", "choices")}
READER_CALL = re.compile(r"\b(" + "|".join(READER_ARGUMENTS) + r")\(\s*\"" + NAME + '"')


def language(path: Path) -> str:
    return {".py": "py", ".sh": "sh"}.get(path.suffix, "cxx")


def without_shell_comments(text: str) -> str:
    """Shell text with its comments blanked, line numbers kept ("run X=1 script" in a comment
    sets nothing)."""
    return re.sub(r"(^|\s)#.*", r"\1", text, flags=re.M)


def source_files(root: Path):
    for top in SCANNED_DIRS:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and path.suffix in SUFFIXES and not rel.startswith(SKIPPED_DIRS):
                text = path.read_text(errors="replace")
                yield rel, without_shell_comments(text) if language(path) == "sh" else text


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def scan_reads(files) -> dict:
    """name -> [(path, line)] of every read of an environment variable."""
    reads: dict = {}
    for rel, text in files:
        for pattern in READ_PATTERNS[language(Path(rel))]:
            for m in pattern.finditer(text):
                reads.setdefault(m.group(1), []).append((rel, line_of(text, m.start())))
    return reads


def switch_value(name: str, text: str) -> str:
    """The value as the page shows it: "0", or "0 unless set" for the shell's ${NAME:-0}."""
    text = text.strip("\"'")
    keep = re.fullmatch(r"\$\{" + name + r":-(.*)\}", text)
    return f"`{keep.group(1)}` unless set" if keep else f"`{text}`"


def scan_foreign_switches(files) -> dict:
    """name -> {value: [paths]} of the NCCL_* (and like) variables that loom's code sets."""
    found: dict = {}
    for rel, text in files:
        for m in SET_PATTERNS[language(Path(rel))].finditer(text):
            value = switch_value(m.group(1), m.group(2))
            paths = found.setdefault(m.group(1), {}).setdefault(value, [])
            if rel not in paths:
                paths.append(rel)
    return found


def loom_variable_table(root: Path) -> dict:
    """kVariables of src/core/env.cc: name -> meaning (adjacent C string literals joined)."""
    text = (root / ENV_CC).read_text()
    block = re.search(r"kVariables\[\]\s*=\s*\{(.*?)\n\};", text, re.S)
    if block is None:
        raise SystemExit(f"{ENV_CC}: no kVariables table found")
    table = {}
    for m in re.finditer(r'\{\s*"(LOOM_[A-Z0-9_]+)"\s*,\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\}', block.group(1)):
        pieces = re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))
        table[m.group(1)] = "".join(pieces).replace('\\"', '"').replace("\\\\", "\\")
    return table


def call_arguments(text: str, open_paren: int) -> list:
    """The top-level comma-separated arguments of the call whose '(' is at open_paren."""
    args, depth, start, i, quote = [], 0, open_paren + 1, open_paren, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'" and not (c == "'" and text[i - 1].isdigit() and text[i + 1 : i + 2].isdigit()):
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    return args


def constants_of(files) -> dict:
    """path -> {name: expression} of the constexpr constants each file defines."""
    pattern = re.compile(r"\bconstexpr\s+[\w:<>]+\s+(k\w+)\s*=\s*([^;]+);")
    return {rel: dict(pattern.findall(text)) for rel, text in files if language(Path(rel)) == "cxx"}


BINARY_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift}


def cxx_value(expr: str, own: dict, everywhere: dict, depth: int = 0):
    """The value of a C++ constant expression of literals, + - * <<, and constexpr names."""
    if depth > 8:
        raise ValueError(f"constants nest too deep in '{expr}'")
    text = re.sub(r"(?<=\d)'(?=\d)", "", expr)                            # 30'000
    text = re.sub(r"\b(?:u?int\d+_t|int|size_t)\{([^}]*)\}", r"(\1)", text)  # int64_t{1}
    text = re.sub(r"\b(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?:ull|ULL|ll|LL|ul|UL|u|U|l|L)\b", r"\1", text)
    text = re.sub(r"\b(?:\w+::)+(?=\w)", "", text)                       # loom::env::kMaxRanksPerGpu

    def evaluate(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -evaluate(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATORS:
            return BINARY_OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.Name) and node.id in (own.keys() | everywhere.keys()):
            return cxx_value(own.get(node.id, everywhere.get(node.id)), own, everywhere, depth + 1)
        raise ValueError(f"cannot evaluate '{expr}'")

    try:
        return evaluate(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"cannot evaluate '{expr}'") from e


def reader_problems(files, documented: dict) -> list:
    """Every reader call whose range, fallback or choices differ from the documented variable."""
    constants = constants_of(files)
    everywhere: dict = {}
    for own in constants.values():
        for name, expr in own.items():
            everywhere.setdefault(name, expr)
    problems = []
    for rel, text in files:
        if language(Path(rel)) != "cxx":
            continue
        for m in READER_CALL.finditer(text):
            var = documented.get(m.group(2))
            if var is None:
                continue
            where = f"{rel}:{line_of(text, m.start())}"
            names = READER_ARGUMENTS[m.group(1)]
            args = call_arguments(text, m.end(1))[1:]
            if len(args) != len(names):
                problems.append(f"{where}: {m.group(1)}({var.name}, ...) has {len(args) + 1} arguments, expected "
                                f"{len(names) + 1}")
                continue
            given = dict(zip(names, args))
            if "choices" in given:
                choices = tuple(re.findall(r'"([^"]*)"', given["choices"]))
                fallback = given["fallback"].strip('"')
                if choices != var.choices or fallback != var.default:
                    problems.append(f"{where}: {var.name} reads one of {choices}, default '{fallback}'; GROUPS "
                                    f"documents {var.choices}, default '{var.default}'")
                continue
            try:
                value = {k: cxx_value(given[k], constants[rel], everywhere) for k in ("lo", "hi")}
                if "fallback" in given and var.default is not None:
                    value["fallback"] = cxx_value(given["fallback"], constants[rel], everywhere)
            except ValueError as e:
                problems.append(f"{where}: {var.name}: {e}")
                continue
            expected = var.other_ranges.get(rel, (var.lo, var.hi))
            if (value["lo"], value["hi"]) != expected:
                problems.append(f"{where}: {var.name} accepts [{value['lo']}, {value['hi']}]; GROUPS documents "
                                f"[{expected[0]}, {expected[1]}]")
            if "fallback" in value and value["fallback"] != var.default:
                problems.append(f"{where}: {var.name} defaults to {value['fallback']}; GROUPS documents {var.default}")
    return problems


# ---- the page ------------------------------------------------------------------------------------

COMPONENTS = (("src/", "library"), ("tools/loom-run/", "loom-run"), ("tools/loom-bench/", "loom-bench"),
              ("python/", "Python package"), ("tests/", "tests"), ("scripts/", "scripts"),
              ("bench/", "bench scripts"), ("examples/", "examples"))
NAMED_BY_COMPONENT = {"library", "loom-run", "loom-bench", "Python package"}  # the others list their files


def readers_text(paths, files: bool = True) -> str:
    paths = list(paths)
    parts = []
    for prefix, component in COMPONENTS:
        mine = sorted({p for p in paths if p.startswith(prefix)})
        if not mine:
            continue
        if component in NAMED_BY_COMPONENT or not files:
            parts.append(component)
        else:
            parts.append(f"{component} ({', '.join(f'`{p}`' for p in mine)})")
    return "; ".join(parts)


def byte_text(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def number_text(x) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def type_text(var: Var) -> str:
    unit = f" {var.unit}" if var.unit else ""
    if var.kind == "integer":
        if var.lo == 0 and var.hi == (1 << 64) - 1:
            return f"unsigned 64-bit integer{unit}"
        return f"integer, {var.lo} to {var.hi}{unit}"
    if var.kind == "bytes":
        return f"byte count, {byte_text(var.lo)} to {byte_text(var.hi)} (K/M/G/T suffixes: powers of 1024)"
    if var.kind == "decimal":
        return f"decimal, {number_text(var.lo)} to {number_text(var.hi)}{unit}"
    if var.kind == "choice":
        return "one of " + ", ".join(f"`{c}`" for c in var.choices)
    return var.text_type


def default_text(var: Var) -> str:
    if var.default_text:
        return var.default_text
    if var.kind == "bytes":
        return byte_text(var.default)
    if var.kind == "choice":
        return f"`{var.default}`"
    return number_text(var.default) + (f" {var.unit}" if var.unit else "")


def cell(text: str) -> str:
    return text.replace("|", "\\|")


INTRO = """\
# Environment variables

<!-- Generated by scripts/dev/env_reference.py; edit src/core/env.cc or that script, then run
     scripts/dev/env_reference.py --write. tests/python/test_env_reference.py checks the page. -->

Every `LOOM_*` variable loom reads, by what it controls, with the launch variables it shares with
torchrun and the NCCL switches its programs set. "Read by": *library* is libloom itself (so every
C++ program and the Python package); *loom-run*, *loom-bench* and *Python package* read the
variable themselves as well.

The library parses its variables when a communicator is created (`Communicator::from_env`,
`from_unique_id`, and their Python forms), unless a note says otherwise. A bad value (`abc`,
`-1`, out of range, set but empty) fails the creation with `invalid_argument` naming the variable,
before any GPU work. A set `LOOM_*` name that the library does not know is logged as a likely typo
(warn level); `LOOM_TEST_*` names are exempt. Non-zero fields of `CommOptions` (in Python the
keyword arguments of the creation methods) override the variables their notes name.
"""

FOREIGN_INTRO = """\
## NCCL and multicast switches loom sets

loom's kernels use no NVLink multicast (NVLS; docs/ARCHITECTURE.md). The baselines beside it
(NCCL, torch's symmetric memory, NVSHMEM) would, and on GPUs shared with other users a program
that uses multicast can put them out of service, so loom's programs and scripts switch it off
for the programs they start ("unless set": the caller's value wins):
"""


def render(groups, table: dict, reads: dict, switches: dict) -> str:
    out = [INTRO]
    for group in groups:
        out.append(f"## {group.title}\n")
        if group.intro:
            out.append(group.intro + "\n")
        out.append("| Variable | Type and range | Default | Read by | Meaning |")
        out.append("|---|---|---|---|---|")
        notes = []
        for var in group.variables:
            meaning = table.get(var.name) or var.meaning
            readers = readers_text((p for p, _ in reads.get(var.name, [])), group.reader_files)
            out.append(f"| `{var.name}` | {cell(type_text(var))} | {cell(default_text(var))} | {cell(readers)} "
                       f"| {cell(meaning)} |")
            note = var.note
            for path, (lo, hi) in sorted(var.other_ranges.items()):
                unit = f" {var.unit}" if var.unit else ""
                note += f" `{path}` accepts {number_text(lo)} to {number_text(hi)}{unit}."
            if var.name.startswith("LOOM_") and not var.name.startswith("LOOM_TEST_") and var.name not in table:
                note += (" Not a `LOOM_TEST_*` name and not in src/core/env.cc's table: a communicator created "
                         "while it is set logs it as a likely typo.")
            if note:
                notes.append(f"- `{var.name}`: {note.strip()}")
        out.append("")
        if notes:
            out.append("\n".join(notes) + "\n")
    out.append(FOREIGN_INTRO)
    if switches:
        out.append("| Variable | Value | Set by |")
        out.append("|---|---|---|")
        for name in sorted(switches):
            for value, paths in sorted(switches[name].items()):
                out.append(f"| `{name}` | {value} | {cell(readers_text(paths))} |")
    else:
        out.append("None.")
    out.append("")
    return "\n".join(out)


# ---- the check ------------------------------------------------------------------------------------

def places(where) -> str:
    shown = ", ".join(f"{p}:{n}" for p, n in where[:3])
    return shown + (f" and {len(where) - 3} more" if len(where) > 3 else "")


def build(root: Path, groups):
    """(problems found in the code, the page the code gives)."""
    files = list(source_files(root))
    reads = scan_reads(files)
    table = loom_variable_table(root)
    documented = {v.name: v for g in groups for v in g.variables}
    scanned = ", ".join(f"{d}/" for d in SCANNED_DIRS)
    problems = []
    for name in sorted(n for n in reads if n.startswith("LOOM_") and n not in documented):
        problems.append(f"{name} is read ({places(reads[name])}) but not documented: add it to GROUPS in "
                        f"scripts/dev/env_reference.py")
    for name in sorted(n for n in documented if n not in reads):
        problems.append(f"{name} is documented, but nothing in {scanned} reads it: remove it from GROUPS")
    library_reads = {n: [w for w in where if w[0].startswith("src/")] for n, where in reads.items()
                     if n.startswith("LOOM_")}
    library_reads = {n: where for n, where in library_reads.items() if where}
    for name in sorted(library_reads.keys() - table.keys()):
        problems.append(f"{name} is read by the library ({places(library_reads[name])}) but missing from "
                        f"kVariables in {ENV_CC}, so unknown_loom_variables() calls it a typo")
    for name in sorted(table.keys() - library_reads.keys()):
        problems.append(f"kVariables in {ENV_CC} lists {name}, but nothing in src/ reads it")
    for name, var in documented.items():
        if name not in table and not var.meaning:
            problems.append(f"{name} has no meaning: neither kVariables in {ENV_CC} nor GROUPS gives one")
    problems += reader_problems(files, documented)
    switches = scan_foreign_switches(files)
    return problems, render(groups, table, reads, switches), reads, switches


def page_problems(current: str, expected: str, reads: dict, switches: dict) -> list:
    if current == expected:
        return []
    listed = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", current, re.M))
    lacking = sorted(n for n in reads if n.startswith("LOOM_") and n not in listed)
    unread = sorted(n for n in listed if n not in reads and n not in switches)
    detail = "".join([f"; it lacks {', '.join(lacking)}" if lacking else "",
                      f"; it lists {', '.join(unread)}, which nothing reads" if unread else ""])
    return [f"{PAGE} is not what the code gives{detail} (run scripts/dev/env_reference.py --write)"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"regenerate {PAGE}")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the checkout (default: this script's)")
    args = parser.parse_args(argv)
    problems, expected, reads, switches = build(args.root, GROUPS)
    page = args.root / PAGE
    if args.write:
        page.write_text(expected)
    else:
        problems += page_problems(page.read_text() if page.exists() else "", expected, reads, switches)
    for problem in problems:
        print(f"env_reference: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
