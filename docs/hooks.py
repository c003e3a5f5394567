"""MkDocs hooks: the generated pages (posattn.docs_gen) join the site at every build.

on_config adds the results store's recipes to the navigation; on_files adds the generated pages
(the mechanism and command-line references, the results pages and the plots they show, the
examples, the changelog and the citation and licence) as files that exist only in the build,
never in docs/. The store is $POSATTN_RESULTS, else the repository's results/.
"""
from __future__ import annotations

import os
from pathlib import Path

from mkdocs.structure.files import File

from posattn import docs_gen
from posattn.experiments import store

RESULTS = os.environ.get(store.ROOT_ENV) or str(Path(__file__).resolve().parents[1] / "results")


def on_config(config):
    for section in config["nav"]:
        if isinstance(section, dict) and "Results" in section:
            section["Results"] = ["results/index.md", *[f"results/{r}.md" for r in store.recipes(RESULTS)]]
    return config


def on_files(files, config):
    for path, content in docs_gen.pages(RESULTS).items():
        files.append(File.generated(config, path, content=content))
    return files
