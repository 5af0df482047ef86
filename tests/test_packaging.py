"""The import names this distribution ships are its own in the test environment.

`kernels` (the layout the spec asks for) is also the import name of Hugging
Face's `kernels` distribution, which transformers >= 5.25 requires and imports
when transformers is imported.  With both installed, one distribution's files
overwrite the other's and every transformers-based test fails far from the
cause; this names it (docs/deploy.md, "The `kernels` import name").
"""

from __future__ import annotations

import importlib.metadata


def test_kernels_import_name_belongs_to_this_distribution_alone():
    owners = set(importlib.metadata.packages_distributions().get("kernels", []))
    assert owners == {"flare-runtime"}, (
        f"the import name 'kernels' is shipped by {sorted(owners)}; a second owner "
        "(Hugging Face's `kernels`, pulled in by transformers >= 5.25) shadows or "
        "overwrites this package's kernels/"
    )
