"""The package's import structure (tokenring/tools/layers.py): layers that only import downwards, and no import
cycle, function-local imports included."""

from tokenring.tools.layers import cycles, imports, layer, modules, upward


def test_every_module_has_a_layer():
    for mod in modules():
        layer(mod)


def test_no_import_cycles():
    assert cycles(imports(modules())) == []


def test_imports_only_go_down():
    assert upward(imports(modules())) == []


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "tokenring"
    (pkg / "strategies").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "settings.py").write_text("from .strategies import base\n")
    (pkg / "strategies" / "__init__.py").write_text("")
    (pkg / "strategies" / "base.py").write_text("def f():\n    from .. import settings\n")
    graph = imports(modules(str(pkg)))
    assert cycles(graph) == [["settings", "strategies.base"]]
    assert upward(graph) == ["tokenring.settings (base) imports tokenring.strategies.base (strategies)"]
