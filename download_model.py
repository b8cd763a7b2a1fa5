#!/usr/bin/env python3
"""Download a static-graph model: `file_list.txt` (lines `path:md5`) and its files.

    python download_model.py --model_name NAME --dir DIR [--nnodes 2 --mode master|slave]
                             [--speculate_model_path DIR]

Layout under the base URL (env MODEL_BASE_URL, default follows PaddleNLP's
public static models):  {base}/{model_name}/file_list.txt  and the files it
lists, relative to it. Multi-node models keep one such list per node under
{model_name}/master/ and {model_name}/slave/; the speculative (MTP) model's
under {model_name}/mtp/.

Each file is fetched into `<file>.part` (resumed with an HTTP Range request
when a previous try left one), checked against its md5, then renamed into
place, so DIR never holds a half-written file under its real name. Files
already present with the right md5 are skipped. Names that would land outside
DIR (absolute, `..`) are refused.

The seeds' DeepSeek-V3/R1 names (`SEED_MODELS`: `deepseek-ai/DeepSeek-R1[-MTP][-2nodes]/FORMAT`) are
known: a `-2nodes` model needs `--nnodes 2`, a one-node one refuses it, a format the table does not
list is refused with the list, and a `-MTP` model without `--speculate_model_path` says its MTP model
was left out. After a download, the layout that arrived is printed (config.json, rank_0 ... rank_{n-1},
tokenizer files) and checked against the table's GPUs per node (8: one rank a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import quote

import requests
from tqdm import tqdm

DEFAULT_BASE_URL = "https://paddlenlp.bj.bcebos.com/models/static"
CHUNK = 1 << 16  # small: what arrived before a dropped connection stays in the .part


# The seeds' deployment table (80 GB GPUs, 8 a node, 8K context): name -> (nodes, MTP model's format or
# None, recommended BLOCK_BS).
SEED_MODELS = {
    "deepseek-ai/DeepSeek-R1/a8w8_fp8_wint4": (1, None, 40),
    "deepseek-ai/DeepSeek-R1-MTP/a8w8_fp8_wint4": (1, "a8w8_fp8", 36),
    "deepseek-ai/DeepSeek-R1/weight_only_int4": (1, None, 40),
    "deepseek-ai/DeepSeek-R1-MTP/weight_only_int4": (1, "weight_only_int8", 36),
    "deepseek-ai/DeepSeek-R1-2nodes/a8w8_fp8": (2, None, 50),
    "deepseek-ai/DeepSeek-R1-MTP-2nodes/a8w8_fp8": (2, "a8w8_fp8", 36),
    "deepseek-ai/DeepSeek-R1-2nodes/weight_only_int8": (2, None, 40),
    "deepseek-ai/DeepSeek-R1-MTP-2nodes/weight_only_int8": (2, "weight_only_int8", 36),
}
GPUS_PER_NODE = 8


class DownloadError(RuntimeError):
    pass


def check_seed_name(name: str, nnodes: int, speculate_model_path: str | None) -> str | None:
    """DownloadError for a seeds' DeepSeek name used against the table; a note to print, or None."""
    family = name.rsplit("/", 1)[0]
    if family not in {n.rsplit("/", 1)[0] for n in SEED_MODELS}:
        return None  # not one of the table's families (e.g. the distills): nothing to check
    if name not in SEED_MODELS:
        known = sorted(n.rsplit("/", 1)[1] for n in SEED_MODELS if n.startswith(family + "/"))
        raise DownloadError(f"--model_name {name}: not in the seeds' DeepSeek table; {family} has {', '.join(known)}")
    nodes, mtp, block_bs = SEED_MODELS[name]
    if nnodes != nodes:
        fix = "--nnodes 2 --mode master|slave" if nodes == 2 else "no --nnodes (one node)"
        raise DownloadError(f"--model_name {name} is a {nodes}-node model, got --nnodes {nnodes}: pass {fix}")
    note = f"{name}: {nodes} node(s) x {GPUS_PER_NODE} GPUs, recommended BLOCK_BS {block_bs} at 8K context"
    if mtp and not speculate_model_path:
        note += f"; its MTP model ({mtp}) was not fetched: pass --speculate_model_path DIR"
    return note


def describe_layout(out_dir: Path, expect_ranks: int | None) -> str:
    """What a download left in out_dir, and a warning when its ranks are not the expected count."""
    ranks = sorted(int(p.name[5:]) for p in out_dir.glob("rank_*") if p.is_dir() and p.name[5:].isdigit())
    names = ["config.json"] if (out_dir / "config.json").is_file() else []
    if ranks:
        names.append(
            f"rank_{ranks[0]} ... rank_{ranks[-1]} ({len(ranks)} ranks)" if len(ranks) > 1 else f"rank_{ranks[0]}"
        )
    names += sorted(p.name for p in out_dir.glob("tokenizer*"))
    line = f"{out_dir}: " + (", ".join(names) or "no config.json, rank_* or tokenizer files")
    if expect_ranks is not None and len(ranks) != expect_ranks:
        line += f" (warning: the seeds' table expects {expect_ranks} rank directories a node, found {len(ranks)})"
    return line


def safe_relpath(name: str, what: str) -> PurePosixPath:
    """A relative path with no `..`, or DownloadError."""
    p = PurePosixPath(name.strip())
    if not name.strip() or p.is_absolute() or ".." in p.parts or "\\" in name or "\x00" in name:
        raise DownloadError(f"refusing {what} {name!r}: it must be a relative path inside the target directory")
    return p


def md5_of(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def parse_file_list(text: str) -> list[tuple[PurePosixPath, str]]:
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, md5 = line.rpartition(":")
        md5 = md5.strip().lower()
        if not sep or len(md5) != 32 or any(c not in "0123456789abcdef" for c in md5):
            raise DownloadError(f"file_list.txt line {n}: expected `path:md5`, got {line!r}")
        entries.append((safe_relpath(name, "file"), md5))
    return entries


def fetch(session: requests.Session, url: str, dest: Path, md5: str, desc: str) -> None:
    """Download url to dest (resuming dest.part), verify md5, rename into place."""
    part = dest.with_name(dest.name + ".part")
    for attempt in range(2):
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        with session.get(url, headers=headers, stream=True, timeout=60) as r:
            if r.status_code == 416:  # the .part is already complete (or bogus): check it below
                pass
            elif r.status_code in (200, 206):
                mode = "ab" if r.status_code == 206 and have else "wb"
                done = have if mode == "ab" else 0
                total = int(r.headers.get("Content-Length", 0)) + done or None
                with (
                    open(part, mode) as f,
                    tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=desc, leave=False) as bar,
                ):
                    for block in r.iter_content(CHUNK):
                        f.write(block)
                        bar.update(len(block))
            else:
                raise DownloadError(f"GET {url}: HTTP {r.status_code}")
        got = md5_of(part)
        if got == md5:
            os.replace(part, dest)
            return
        part.unlink()  # corrupt: start again from zero once
        if attempt:
            raise DownloadError(f"{desc}: md5 {got} does not match file_list.txt ({md5})")


def download_tree(session: requests.Session, base: str, out_dir: Path) -> int:
    """Fetch base/file_list.txt and every file it lists into out_dir; returns files fetched."""
    r = session.get(f"{base}/file_list.txt", timeout=60)
    if r.status_code != 200:
        raise DownloadError(f"GET {base}/file_list.txt: HTTP {r.status_code}")
    entries = parse_file_list(r.text)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = out_dir.resolve()
    fetched = 0
    for rel, md5 in tqdm(entries, desc="files", unit="file"):
        dest = (root / rel).resolve()
        if not dest.is_relative_to(root):  # symlinks inside DIR pointing out of it
            raise DownloadError(f"refusing file {str(rel)!r}: it resolves outside {root}")
        if dest.exists() and md5_of(dest) == md5:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        fetch(session, f"{base}/{quote(str(rel))}", dest, md5, str(rel))
        fetched += 1
    return fetched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_name", default="deepseek-ai/DeepSeek-R1/weight_only_int4")
    ap.add_argument("--dir", default="downloads", help="where the model goes")
    ap.add_argument("--nnodes", type=int, default=1, help="number of nodes of a multi-node model")
    ap.add_argument(
        "--mode", default="master", choices=["master", "slave"], help="which node's part (multi-node models)"
    )
    ap.add_argument("--speculate_model_path", default=None, help="also fetch the speculative (MTP) model here")
    ap.add_argument("--base_url", default=os.environ.get("MODEL_BASE_URL", DEFAULT_BASE_URL))
    args = ap.parse_args(argv)
    try:
        name = safe_relpath(args.model_name, "model name")
        if args.nnodes < 1:
            raise DownloadError(f"--nnodes must be >= 1, got {args.nnodes}")
        note = check_seed_name(str(name), args.nnodes, args.speculate_model_path)
        model_url = f"{args.base_url.rstrip('/')}/{quote(str(name))}"
        node_url = f"{model_url}/{args.mode}" if args.nnodes > 1 else model_url
        with requests.Session() as session:
            n = download_tree(session, node_url, Path(args.dir))
            print(f"{args.model_name}: {n} file(s) downloaded into {args.dir}")
            print(describe_layout(Path(args.dir), GPUS_PER_NODE if note else None))
            if args.speculate_model_path:
                n = download_tree(session, f"{model_url}/mtp", Path(args.speculate_model_path))
                print(f"{args.model_name} (speculative model): {n} file(s) downloaded into {args.speculate_model_path}")
            if note:
                print(note)
    except (DownloadError, requests.RequestException, OSError) as e:
        print(f"download_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
