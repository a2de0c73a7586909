"""Rebuild the fact-world asset `src/stemlm/assets/facts/countries.json` from public packages.

    python scripts/build_facts.py            # downloads two wheels with pip, writes the asset

Provenance: country facts (name, capital, region, subregion, demonym, language and currency codes) come from
the JSON files of the PyPI package `countryinfo==1.0.1` (MIT licence); language and currency codes are given
English names with the ISO 639 / ISO 4217 tables in `pycountry==26.2.16` (LGPL-2.1, data from Debian's
iso-codes). Only facts are extracted; no code of either package is used at run time. The output is sorted
and written without timestamps, so a rebuild is byte-identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "stemlm" / "assets" / "facts" / "countries.json"
PACKAGES = ("countryinfo==1.0.1", "pycountry==26.2.16")


def download(spec: str, folder: Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder), spec],
        check=True,
    )
    name = spec.split("==")[0]
    (wheel,) = folder.glob(f"{name}-*.whl")
    return zipfile.ZipFile(wheel)


def iso_names(pycountry: zipfile.ZipFile, member: str, key: str, code_field: str) -> dict[str, str]:
    table = json.loads(pycountry.read(f"pycountry/databases/{member}"))[key]
    return {entry[code_field]: entry["name"] for entry in table if code_field in entry}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        countryinfo = download(PACKAGES[0], Path(tmp))
        pycountry = download(PACKAGES[1], Path(tmp))
        languages = iso_names(pycountry, "iso639-3.json", "639-3", "alpha_2")
        currencies = iso_names(pycountry, "iso4217.json", "4217", "alpha_3")
        countries: dict[str, dict] = {}
        for member in sorted(countryinfo.namelist()):
            if not (member.startswith("countryinfo/data/") and member.endswith(".json")):
                continue
            raw = json.loads(countryinfo.read(member))
            capital = raw.get("capital")
            capital = capital[0] if isinstance(capital, list) and capital else capital
            # The package ships one country twice (two file names); keep the first by sorted file name.
            if not raw.get("name") or not capital or raw["name"] in countries:
                continue
            countries[raw["name"]] = {
                "name": raw["name"],
                "capital": capital,
                "region": raw.get("region") or None,
                "subregion": raw.get("subregion") or None,
                "demonym": raw.get("demonym") or None,
                "languages": [languages[c] for c in raw.get("languages", []) if c in languages],
                "currencies": [currencies[c] for c in raw.get("currencies", []) if c in currencies],
            }
    countries = sorted(countries.values(), key=lambda c: c["name"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"source": list(PACKAGES), "countries": countries}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(countries)} countries to {OUT}")


if __name__ == "__main__":
    main()
