"""The typing files of the package: py.typed, and loom/_C.pyi (kept by hand) against the compiled
module: the same names, and for every function the same parameters (names, defaults, types) as
nanobind reports (``__nb_signature__``)."""

import ast
import re
from pathlib import Path

import pytest

import loom
from loom import _C

PACKAGE = Path(loom.__file__).parent


def stub_tree() -> ast.Module:
    return ast.parse((PACKAGE / "_C.pyi").read_text())


def parameters(fn: ast.FunctionDef) -> list:
    """(name, annotation, has a default) of each parameter; `self` left out."""
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    return [(a.arg, ast.unparse(a.annotation) if a.annotation else None, d is not None)
            for a, d in zip(args, defaults) if a.arg != "self"]


def native_parameters(obj, name: str) -> list:
    """The parameters nanobind reports for a function (its first overload)."""
    text = obj.__nb_signature__[0][0]
    text = re.sub(r"\\\d+", "...", text).replace("def (", f"def {name}(", 1)  # default values are placeholders
    # The stub names Sequence and Communicator without their modules.
    text = re.sub(r"\s*->.*$", "", text).replace("collections.abc.", "").replace("loom._C.", "")
    return parameters(ast.parse(text + ": ...").body[0])


def stub_functions(body) -> dict:
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef)}


def test_py_typed_marker_ships_with_the_package():
    assert (PACKAGE / "py.typed").is_file()


def test_stub_names_are_the_module_names():
    tree = stub_tree()
    stub_names = set(stub_functions(tree.body)) | {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    stub_names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    module_names = {n for n in dir(_C) if not n.startswith("__")} | {"__version__"}
    assert stub_names == module_names


def test_stub_functions_match_the_extension():
    for name, fn in stub_functions(stub_tree().body).items():
        assert parameters(fn) == native_parameters(getattr(_C, name), name), name


def test_stub_communicator_matches_the_extension():
    cls = next(n for n in stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "Communicator")
    methods = stub_functions(cls.body)
    native = {n for n in dir(_C.Communicator) if not n.startswith("_")}
    assert set(methods) == native
    for name, fn in methods.items():
        member = _C.Communicator.__dict__[name]
        is_property = any(ast.unparse(d) == "property" for d in fn.decorator_list)
        assert is_property == isinstance(member, property), name
        target = member.fget if is_property else getattr(_C.Communicator, name)
        assert parameters(fn) == native_parameters(target, name), name


def test_stub_matches_nanobind_stubgen_where_it_is_installed(tmp_path):
    """Where nanobind is importable, its stub generator agrees with the hand-kept file, up to the
    deliberate differences (the header comment, empty()'s return type, the underscore names)."""
    stubgen = pytest.importorskip("nanobind.stubgen")
    generated = tmp_path / "_C.pyi"
    stubgen.main(["-m", "loom._C", "-o", str(generated), "-q"])
    kept = {n.name: ast.dump(n) for n in ast.walk(stub_tree()) if isinstance(n, ast.FunctionDef)}
    made = {n.name: ast.dump(n) for n in ast.walk(ast.parse(generated.read_text())) if isinstance(n, ast.FunctionDef)}
    differ = {name for name in made if kept.get(name) != made[name]}
    assert differ <= {"empty"}, differ
