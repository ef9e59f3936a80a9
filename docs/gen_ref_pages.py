"""Writes the API reference pages (run by mkdocs-gen-files at build time).

One page per public module, curated: ``gradfuse`` (every name of ``gradfuse.__all__``, grouped
by task) and the module paths users import. A module page shows the module's docstring and the
names that live only there; names re-exported by ``gradfuse`` are documented once, on the
``gradfuse`` page, and linked from the module page. Everything is read from the source (ast here,
griffe in mkdocstrings): building the docs needs no torch.

A name of ``gradfuse.__all__`` in no group below is documented under "Other names" (put it in
a group); a grouped name that is not (or no longer) public is left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent

# The gradfuse page: (section, intro, names), in reading order.
TOP_GROUPS = [
    ("Statistics", "One fused pass over every gradient (or any tensors); results stay on the device.",
     ["stats", "tensor_stats", "GradStats", "watch", "GradWatch"]),
    ("Clipping", "Drop-ins for `torch.nn.utils` and gradfuse's own modes; see the clipping guide.",
     ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "clip_", "clip_grad_value_",
      "adaptive_clip_grad_", "ZClip", "unscale_clip_"]),
    ("Monitoring", "The monitor, its reports, the one-line attachment to an optimizer, and a count of "
     "the host's reads (what would wait for a GPU).",
     ["attach", "Attachment", "GradMonitor", "StepReport", "GradientAnomaly", "HostReads"]),
    ("Flight recorder", "The last steps of every layer on the device, spikes, dumps and their diagnosis; "
     "see the guide on diagnosing a spike.",
     ["FlightRecorder", "load_dump", "explain"]),
    ("Sinks", "Where the monitor's records go: the `Sink` protocol and the sinks gradfuse ships (also "
     "importable from `gradfuse.sinks`).",
     ["Sink", "JsonlSink", "TensorBoardSink", "MetricsSink", "WandbSink", "MLflowSink", "LoggingSink",
      "PrometheusSink"]),
    ("Activations", "Statistics of module outputs and of the gradients with respect to them.",
     ["capture_activations", "ActivationCapture", "ActivationStats"]),
    ("Training dynamics", "The gradient noise scale, and update clipping (the optimizer's update limited "
     "per parameter); see the guide on noise scale, update statistics and update clipping.",
     ["NoiseScale", "clip_update_rms", "UpdateClip"]),
    ("Build and backend", "What the extension was built for, and which backend runs.",
     ["backend", "build_info"]),
]

# (module, page title, public names: None = the module's __all__)
MODULES = [
    ("gradfuse.clip", "gradfuse.clip", None),
    ("gradfuse.monitor.sinks", "gradfuse.sinks", None),
    ("gradfuse.numerics.histogram", "gradfuse.histogram", None),
    ("gradfuse.numerics.headroom", "gradfuse.headroom", None),
    ("gradfuse.activations", "gradfuse.activations", None),
    ("gradfuse.dynamics", "gradfuse.dynamics", None),
    ("gradfuse.optim", "gradfuse.optim", None),
    ("gradfuse.viz.explain", "gradfuse.viz.explain", ["Diagnosis", "Event", "Departure", "NonFiniteOrigin",
                                                      "plot_dump", "dump_figure"]),
    ("gradfuse.viz.updates", "gradfuse.viz.updates", ["plot_updates", "update_figure", "has_updates",
                                                      "updates_path"]),
    ("gradfuse.monitor.flight_dump", "gradfuse.monitor.flight_dump", ["FlightDump", "write_dump", "load_dump"]),
    ("gradfuse.integrations.pytorch", "gradfuse.integrations.pytorch", ["Attachment", "attach"]),
    ("gradfuse.integrations.step_gate", "gradfuse.integrations.step_gate", ["StepGate"]),
    ("gradfuse.integrations.lightning", "gradfuse.integrations.lightning", ["GradfuseCallback"]),
    ("gradfuse.integrations.transformers", "gradfuse.integrations.transformers",
     ["GradfuseCallback", "attach"]),
    ("gradfuse.integrations.deepspeed", "gradfuse.integrations.deepspeed",
     ["DeepSpeedAttachment", "attach_engine", "unsupported_setting", "check_version"]),
    ("gradfuse.integrations.torchtitan", "gradfuse.integrations.torchtitan",
     ["TorchtitanAttachment", "attach", "check_version"]),
]


def source_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def defined_in(module: str) -> set[str]:
    """The names a module defines (def, class, assignment), not those it imports."""
    tree = ast.parse(source_of(module).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def dunder_all(module: str) -> list[str]:
    tree = ast.parse(source_of(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"{module} has no __all__")


top_all = [n for n in dunder_all("gradfuse") if not n.startswith("_")]
grouped = {n for _, _, names in TOP_GROUPS for n in names}
TOP_GROUPS = [(title, intro, [n for n in names if n in top_all]) for title, intro, names in TOP_GROUPS]
ungrouped = [n for n in top_all if n not in grouped]
if ungrouped:
    TOP_GROUPS.append(("Other names", "Public names not yet placed in a section above.", ungrouped))

nav = mkdocs_gen_files.Nav()

with mkdocs_gen_files.open("reference/gradfuse.md", "w") as f:
    f.write("# gradfuse\n\n")
    f.write("Every public name, importable as `gradfuse.<name>`. The module pages in this "
            "section hold what lives only in a submodule.\n\n")
    f.write("::: gradfuse\n    options:\n      members: false\n      show_root_heading: false\n"
            "      show_root_toc_entry: false\n\n")
    for title, intro, names in TOP_GROUPS:
        f.write(f"## {title}\n\n{intro}\n\n")
        for name in names:
            f.write(f"::: gradfuse.{name}\n    options:\n      heading_level: 3\n"
                    "      show_root_full_path: false\n\n")
nav["gradfuse"] = "gradfuse.md"

for module, title, names in MODULES:
    public = names if names is not None else dunder_all(module)
    defined = defined_in(module)  # a name the module defines itself is its own, even if
    own = [n for n in public if n not in top_all or n in defined]  # gradfuse has one of that name
    shared = [n for n in public if n in top_all and n not in defined]
    page = f"reference/{title}.md"
    with mkdocs_gen_files.open(page, "w") as f:
        f.write(f"# {title}\n\n")
        if title != module:
            f.write(f"`{title}` re-exports `{module}`; both paths work.\n\n")
        if shared:
            links = ", ".join(f"[`{n}`][gradfuse.{n}]" for n in shared)
            f.write(f"Also here, documented on the [gradfuse](gradfuse.md) page: {links}.\n\n")
        f.write(f"::: {module}\n    options:\n      show_root_heading: false\n"
                "      show_root_toc_entry: false\n")
        if own:
            f.write("      members:\n" + "".join(f"        - {n}\n" for n in own))
        else:
            f.write("      members: false\n")
        f.write("\n")
    nav[title] = f"{title}.md"

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as f:
    f.writelines(nav.build_literate_nav())

# The changelog page includes CHANGELOG.md (pymdownx.snippets); nothing to copy.
