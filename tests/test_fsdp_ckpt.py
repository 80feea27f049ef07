#!/usr/bin/env python3
"""Tests tools/fsdp-ckpt on real checkpoints.

ckpt_maker (tests/ckpt_maker.c, public C ABI only) trains a 4-rank FULL_SHARD
job for two steps and saves it sharded and full; it also loads any checkpoint
at any world size and prints every param's gathered values as hex float bits,
so values are compared bitwise. Safetensors files are read here by hand
(struct + json), independently of the library.

usage: test_fsdp_ckpt.py --tool FSDP_CKPT --maker CKPT_MAKER --work DIR GROUP
GROUP is one of: cli inspect verify consolidate reshard (one CTest each).
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import unittest
import zlib

TOOL = None
MAKER = None
WORK = None

# (unit, param, shape) in registration order, as ckpt_maker registers them.
PARAMS = [
    ("embed", "embed.weight", [10, 8]),
    ("block", "block.weight", [6, 6]),
    ("block", "block.bias", [7]),
    ("block", "block.norm", [3]),
    ("head", "head.weight", [2, 6]),
    ("head", "head.bias", [7]),
]
UNITS = ["embed", "block", "head"]
STATES = ["exp_avg", "exp_avg_sq"]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def run(args, timeout=120):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def tool(*args):
    return run([TOOL, *args])


def maker(*args):
    """Runs ckpt_maker; returns {param name: [hex bits]} in output order."""
    r = run([MAKER, *args])
    if r.returncode != 0:
        raise AssertionError("ckpt_maker %s failed (%d):\n%s%s" % (" ".join(map(str, args)), r.returncode,
                                                                    r.stdout, r.stderr))
    out = {}
    for line in r.stdout.splitlines():
        words = line.split()
        name, n, bits = words[0], int(words[1]), words[2:]
        if len(bits) != n:
            raise AssertionError("ckpt_maker printed %d values for %s, expected %d" % (len(bits), name, n))
        out[name] = bits
    return out


def read_safetensors(path):
    """A strict, independent safetensors reader: returns (metadata, [(name, dtype, shape, raw bytes)]) in data
    order, after checking the 8-byte header length, the JSON, and that the tensors tile the data section up to
    the end of the file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise AssertionError("%s: too short" % path)
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise AssertionError("%s: header length %d past the end" % (path, n))
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", None)
    data = blob[8 + n:]
    tensors = []
    for name, t in header.items():
        b, e = t["data_offsets"]
        if t["dtype"] != "F32" or e - b != 4 * numel(t["shape"]):
            raise AssertionError("%s: tensor %s: dtype %s shape %s offsets %s" % (path, name, t["dtype"], t["shape"],
                                                                                  t["data_offsets"]))
        tensors.append((name, t["dtype"], t["shape"], data[b:e], b))
    tensors.sort(key=lambda x: x[4])
    pos = 0
    for name, _, _, raw, b in tensors:
        if b != pos:
            raise AssertionError("%s: tensor %s starts at %d, expected %d" % (path, name, b, pos))
        pos += len(raw)
    if pos != len(data):
        raise AssertionError("%s: tensors end at %d, data section has %d bytes" % (path, pos, len(data)))
    return metadata, [(name, dt, shape, raw) for name, dt, shape, raw, _ in tensors]


def bits(raw):
    return ["%08x" % v for v in struct.unpack("<%dI" % (len(raw) // 4), raw)]


def tensor_offset(path, tensor):
    """Absolute file offset of `tensor`'s first data byte."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[tensor]["data_offsets"][0], header[tensor]["data_offsets"][1] - header[tensor]["data_offsets"][0]


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def read_meta(d):
    with open(os.path.join(d, "fsdp_checkpoint.json")) as f:
        return json.load(f)


def write_meta_consistently(d, text):
    """Rewrites the metadata and its CRC-32 file together (what the field checks see)."""
    with open(os.path.join(d, "fsdp_checkpoint.json"), "w") as f:
        f.write(text)
    with open(os.path.join(d, "fsdp_checkpoint.json.crc32"), "w") as f:
        f.write("%08x\n" % zlib.crc32(text.encode()))


def dir_bytes(d):
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


class Base(unittest.TestCase):
    """Fresh checkpoints per test class: sharded and full, plus the params' bits after training."""

    @classmethod
    def setUpClass(cls):
        cls.work = os.path.join(WORK, cls.__name__)
        shutil.rmtree(cls.work, ignore_errors=True)
        os.makedirs(cls.work)
        cls.sharded = os.path.join(cls.work, "src_sharded")
        cls.full = os.path.join(cls.work, "src_full")
        if cls.needs_checkpoints:
            cls.gathered = maker("make", cls.sharded, cls.full)
            assert [p for _, p, _ in PARAMS] == list(cls.gathered), list(cls.gathered)

    needs_checkpoints = True

    def path(self, name):
        return os.path.join(self.work, name)

    def copy(self, src, name):
        dst = self.path(name)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        return dst

    def assertRc(self, r, rc):
        self.assertEqual(r.returncode, rc, "exit %d, expected %d\nstdout:\n%s\nstderr:\n%s" % (r.returncode, rc,
                                                                                               r.stdout, r.stderr))

    def assertNoDir(self, d):
        self.assertFalse(os.path.exists(d), "%s exists" % d)
        staging = os.path.join(os.path.dirname(d), "." + os.path.basename(d) + ".fsdp-staging")
        self.assertFalse(os.path.exists(staging), "%s was left behind" % staging)

    def assertLoads(self, d, world, expected, *extra):
        got = maker("load", d, world, *extra)
        self.assertEqual(list(got), list(expected))
        for name in expected:
            self.assertEqual(got[name], expected[name], "param %s of %s loaded at world %d" % (name, d, world))


class Cli(Base):
    needs_checkpoints = False

    def test_help_for_the_tool_and_each_command(self):
        for args, head in [(["--help"], "usage: fsdp-ckpt <command>"), (["-h"], "usage: fsdp-ckpt <command>"),
                           (["help"], "usage: fsdp-ckpt <command>"), (["inspect", "--help"], "usage: fsdp-ckpt inspect"),
                           (["verify", "-h"], "usage: fsdp-ckpt verify"),
                           (["consolidate", "--help"], "usage: fsdp-ckpt consolidate"),
                           (["reshard", "--help"], "usage: fsdp-ckpt reshard --world N"),
                           (["help", "reshard"], "usage: fsdp-ckpt reshard")]:
            r = tool(*args)
            self.assertRc(r, 0)
            self.assertTrue(r.stdout.startswith(head), "%s printed:\n%s" % (args, r.stdout))
            self.assertEqual(r.stderr, "")

    def test_no_arguments_prints_usage_to_stderr(self):
        r = tool()
        self.assertRc(r, 2)
        self.assertIn("usage: fsdp-ckpt", r.stderr)
        self.assertEqual(r.stdout, "")

    def test_unknown_command(self):
        r = tool("frobnicate", "x")
        self.assertRc(r, 2)
        self.assertRegex(r.stderr, r"^fsdp-ckpt: unknown command 'frobnicate'")

    def test_unknown_option_and_wrong_argument_counts(self):
        for args in [["inspect", "d", "--bogus"], ["verify", "--json", "d"], ["verify"], ["inspect", "a", "b"],
                     ["consolidate", "a"], ["consolidate", "a", "b", "c"], ["reshard", "a", "b"],
                     ["reshard", "a", "b", "--world"], ["inspect", "--json=1", "d"]]:
            r = tool(*args)
            self.assertRc(r, 2)
            self.assertTrue(r.stderr.startswith("fsdp-ckpt: "), r.stderr)

    def test_missing_directory_is_an_error_naming_it(self):
        d = self.path("no_such_checkpoint")
        r = tool("inspect", d)
        self.assertRc(r, 3)
        self.assertIn(d, r.stderr)


class Inspect(Base):
    def test_text(self):
        r = tool("inspect", self.sharded)
        self.assertRc(r, 0)
        out = r.stdout
        self.assertRegex(out, r"(?m)^kind\s+sharded$")
        self.assertRegex(out, r"(?m)^format\s+libfsdp-checkpoint version 1$")
        self.assertRegex(out, r"(?m)^world size\s+4$")
        self.assertRegex(out, r"(?m)^sharding\s+FULL_SHARD$")
        self.assertRegex(out, r"(?m)^shard world\s+4$")
        self.assertRegex(out, r"(?m)^step\s+2$")
        self.assertRegex(out, r"(?m)^optimizer\s+adamw lr=0\.01 ")
        self.assertRegex(out, r"(?m)state \[exp_avg, exp_avg_sq\]")
        self.assertRegex(out, r"(?m)^loss scale\s+1 ")
        for unit, name, shape in PARAMS:
            shape_s = "[" + ", ".join(map(str, shape)) + "]"
            self.assertRegex(out, r"(?m)^\s+%s\s+%s\s+F32 numel %d\b" % (re.escape(name), re.escape(shape_s),
                                                                         numel(shape)))
        for u in UNITS:
            self.assertRegex(out, r"(?m)^  unit \d+ '%s'" % u)
        total = 0
        for s in range(4):
            f = "shard-%05d-of-00004.safetensors" % s
            size = os.path.getsize(os.path.join(self.sharded, f))
            total += size
            self.assertRegex(out, r"(?m)^  %s\s+%d bytes" % (re.escape(f), size))
        self.assertRegex(out, r"(?m)^total\s+%d bytes$" % total)

    def test_json(self):
        r = tool("inspect", self.sharded, "--json")
        self.assertRc(r, 0)
        j = json.loads(r.stdout)
        raw = read_meta(self.sharded)
        self.assertEqual(j["kind"], "sharded")
        self.assertEqual(j["format_version"], 1)
        self.assertEqual(j["library"], raw["library"])
        self.assertEqual(j["world_size"], 4)
        self.assertEqual(j["shard_world"], 4)
        self.assertEqual(j["sharding"], "FULL_SHARD")
        self.assertEqual(j["step"], 2)
        self.assertEqual(j["optimizer"]["kind"], "adamw")
        self.assertEqual(j["optimizer"]["lr"], 0.01)
        self.assertEqual(j["optimizer"]["state"], STATES)
        self.assertEqual(j["loss_scaler"]["scale"], 1.0)
        got = [(u["name"], p["name"], p["shape"]) for u in j["units"] for p in u["params"]]
        self.assertEqual(got, PARAMS)
        for u, ru in zip(j["units"], raw["units"]):
            self.assertEqual(u["padded_numel"], ru["padded_numel"])
            for p, rp in zip(u["params"], ru["params"]):
                self.assertEqual((p["dtype"], p["numel"], p["offset"]), ("F32", numel(p["shape"]), rp["offset"]))
        files = {f["name"]: f["size"] for f in j["files"]}
        self.assertEqual(files, {f: os.path.getsize(os.path.join(self.sharded, f))
                                 for f in os.listdir(self.sharded) if f.endswith(".safetensors")})
        self.assertEqual(j["total_bytes"], sum(files.values()))

    def test_json_of_a_full_checkpoint(self):
        r = tool("inspect", "--json", self.full)
        self.assertRc(r, 0)
        j = json.loads(r.stdout)
        self.assertEqual((j["kind"], j["shard_world"], j["world_size"], j["step"]), ("full", 1, 4, 2))
        self.assertEqual(sorted(f["name"] for f in j["files"]), ["model.safetensors", "optimizer.safetensors"])

    def test_corrupt_metadata_exits_1(self):
        d = self.copy(self.sharded, "bad_meta")
        meta = read_meta(d)
        del meta["units"][1]["params"][0]["shape"]
        write_meta_consistently(d, json.dumps(meta))
        r = tool("inspect", d)
        self.assertRc(r, 1)
        self.assertIn(os.path.join(d, "fsdp_checkpoint.json"), r.stderr)
        self.assertIn("units[1].params[0].shape", r.stderr)


class Verify(Base):
    def verify_fails(self, d, *needles):
        r = tool("verify", d)
        self.assertRc(r, 1)
        self.assertNotIn("OK", r.stdout)
        for n in needles:
            self.assertIn(n, r.stderr)
        return r

    def test_good_checkpoints(self):
        for d, files in [(self.sharded, 4), (self.full, 2)]:
            r = tool("verify", d)
            self.assertRc(r, 0)
            self.assertRegex(r.stdout, r"^OK: .*: %d files" % files)

    def test_flipped_data_byte_names_file_and_tensor(self):
        d = self.copy(self.sharded, "flip_data")
        f = os.path.join(d, "shard-00001-of-00004.safetensors")
        off, n = tensor_offset(f, "units.1.exp_avg")
        flip_byte(f, off + n // 2)
        self.verify_fails(d, f, "'units.1.exp_avg' fails its checksum")

    def test_flipped_byte_in_a_full_model_file(self):
        d = self.copy(self.full, "flip_full")
        f = os.path.join(d, "model.safetensors")
        off, n = tensor_offset(f, "block.bias")
        flip_byte(f, off + n - 1)
        self.verify_fails(d, f, "'block.bias'")

    def test_flipped_header_byte(self):
        d = self.copy(self.sharded, "flip_header")
        f = os.path.join(d, "shard-00000-of-00004.safetensors")
        flip_byte(f, 12)
        self.verify_fails(d, f, "header")

    def test_truncated_file(self):
        d = self.copy(self.sharded, "truncated")
        f = os.path.join(d, "shard-00002-of-00004.safetensors")
        os.truncate(f, os.path.getsize(f) - 4)
        self.verify_fails(d, f, "truncated")

    def test_deleted_file(self):
        d = self.copy(self.sharded, "deleted")
        f = os.path.join(d, "shard-00003-of-00004.safetensors")
        os.remove(f)
        self.verify_fails(d, f, "missing")

    def test_bad_json_metadata(self):
        d = self.copy(self.sharded, "bad_json")
        m = os.path.join(d, "fsdp_checkpoint.json")
        with open(m) as f:
            text = f.read()
        write_meta_consistently(d, text[:len(text) // 2])
        self.verify_fails(d, m, "not valid JSON")

    def test_changed_metadata_fails_its_checksum(self):
        d = self.copy(self.sharded, "meta_digit")
        m = os.path.join(d, "fsdp_checkpoint.json")
        with open(m) as f:
            text = f.read()
        self.assertIn('"step": 2', text)
        with open(m, "w") as f:
            f.write(text.replace('"step": 2', '"step": 3'))
        self.verify_fails(d, m, "fails its checksum")

    def test_checkpoint_saved_after_a_skipped_step(self):
        # A step skipped for inf grads leaves last_grad_norm = inf, which JSON writes as null: the checkpoint
        # must still verify and load.
        s, f = self.path("skipped_sharded"), self.path("skipped_full")
        gathered = maker("make", s, f, "--skip-last")
        for d in (s, f):
            self.assertRc(tool("verify", d), 0)
            self.assertLoads(d, 2, gathered)


class Consolidate(Base):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.out = os.path.join(cls.work, "consolidated")
        cls.result = tool("consolidate", cls.sharded, cls.out)

    def test_exit_status_and_files(self):
        self.assertRc(self.result, 0)
        self.assertEqual(sorted(os.listdir(self.out)),
                         ["fsdp_checkpoint.json", "fsdp_checkpoint.json.crc32", "model.safetensors",
                          "optimizer.safetensors"])
        self.assertFalse(os.path.exists(os.path.join(self.work, ".consolidated.fsdp-staging")))

    def test_model_file_holds_the_params_by_name_shape_and_bits(self):
        md, tensors = read_safetensors(os.path.join(self.out, "model.safetensors"))
        self.assertEqual(md["format"], "pt")
        self.assertEqual(md["written_by"], read_meta(self.sharded)["library"])
        self.assertEqual([(n, s) for n, _, s, _ in tensors], [(p, s) for _, p, s in PARAMS])
        for name, _, _, raw in tensors:
            self.assertEqual(bits(raw), self.gathered[name], name)

    def test_optimizer_file_names_and_shapes(self):
        _, tensors = read_safetensors(os.path.join(self.out, "optimizer.safetensors"))
        want = [(p + "." + s, shape) for u in UNITS for s in STATES for uu, p, shape in PARAMS if uu == u]
        self.assertEqual([(n, s) for n, _, s, _ in tensors], want)

    def test_same_bytes_as_the_library_full_save(self):
        self.assertEqual(dir_bytes(self.out), dir_bytes(self.full))

    def test_loads_at_world_2(self):
        self.assertLoads(self.out, 2, self.gathered)

    def test_optimizer_state_survives(self):
        # One more step after the load: equal only if the moments were restored to the same values.
        self.assertLoads(self.out, 2, maker("load", self.sharded, 2, "--step"), "--step")

    def test_output_verifies_and_inspects_as_full(self):
        self.assertRc(tool("verify", self.out), 0)
        j = json.loads(tool("inspect", "--json", self.out).stdout)
        self.assertEqual((j["kind"], j["shard_world"], j["world_size"], j["step"]), ("full", 1, 4, 2))

    def test_full_to_full(self):
        out = self.path("full_again")
        self.assertRc(tool("consolidate", self.full, out), 0)
        self.assertEqual(dir_bytes(out), dir_bytes(self.full))

    def test_corrupt_source_exits_1_and_leaves_no_destination(self):
        src = self.copy(self.sharded, "corrupt_src")
        f = os.path.join(src, "shard-00002-of-00004.safetensors")
        off, n = tensor_offset(f, "units.0.param")
        flip_byte(f, off + 3)
        dst = self.path("from_corrupt")
        r = tool("consolidate", src, dst)
        self.assertRc(r, 1)
        self.assertIn(f, r.stderr)
        self.assertIn("units.0.param", r.stderr)
        self.assertNoDir(dst)
        # An older checkpoint at DST stays as it was.
        old = self.copy(self.full, "old_dst")
        before = dir_bytes(old)
        self.assertRc(tool("consolidate", src, old), 1)
        self.assertEqual(dir_bytes(old), before)

    def test_replaces_an_older_checkpoint(self):
        dst = self.copy(self.sharded, "replace_me")
        self.assertRc(tool("consolidate", self.sharded, dst), 0)
        self.assertEqual(dir_bytes(dst), dir_bytes(self.full))

    def test_refuses_its_source_and_its_parents(self):
        before = dir_bytes(self.sharded)
        for dst in [self.sharded, self.sharded + "/", os.path.join(self.sharded, "sub"),
                    os.path.join(self.sharded, "..", os.path.basename(self.sharded)), self.work]:
            r = tool("consolidate", self.sharded, dst)
            self.assertRc(r, 2)
        self.assertEqual(dir_bytes(self.sharded), before)

    def test_refuses_a_directory_that_is_not_a_checkpoint(self):
        dst = self.path("precious")
        os.makedirs(dst, exist_ok=True)
        with open(os.path.join(dst, "keep.txt"), "w") as f:
            f.write("mine")
        r = tool("consolidate", self.sharded, dst)
        self.assertRc(r, 3)
        self.assertIn(dst, r.stderr)
        self.assertEqual(os.listdir(dst), ["keep.txt"])

    def consolidate_refuses(self, option, why):
        name = option.strip("-")
        src, dst = self.path(name + "_sharded"), self.path(name + "_full")
        maker("make", src, "-", option)
        r = tool("consolidate", src, dst)
        self.assertRc(r, 3)
        self.assertIn(why, r.stderr)
        self.assertNoDir(dst)

    def test_duplicate_param_names_are_refused(self):
        self.consolidate_refuses("--dup-names", "'block.bias' is used twice")

    def test_a_param_named_like_the_safetensors_metadata_is_refused(self):
        # A full checkpoint names tensors by param name, and "__metadata__" is the header's own key.
        self.consolidate_refuses("--reserved-name", "'__metadata__' (unit 'head') is reserved by safetensors")

    def test_sgd_without_state_writes_only_the_model(self):
        src, dst = self.path("sgd_sharded"), self.path("sgd_full")
        gathered = maker("make", src, "-", "--optimizer", "sgd")
        self.assertRc(tool("consolidate", src, dst), 0)
        self.assertEqual(sorted(os.listdir(dst)),
                         ["fsdp_checkpoint.json", "fsdp_checkpoint.json.crc32", "model.safetensors"])
        self.assertLoads(dst, 1, gathered, "--optimizer", "sgd")


class Reshard(Base):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.out = os.path.join(cls.work, "world3")
        cls.result = tool("reshard", "--world", "3", cls.sharded, cls.out)

    def test_exit_status_files_and_metadata(self):
        self.assertRc(self.result, 0)
        self.assertEqual(sorted(os.listdir(self.out)), ["fsdp_checkpoint.json", "fsdp_checkpoint.json.crc32"] +
                         ["shard-%05d-of-00003.safetensors" % s for s in range(3)])
        m = read_meta(self.out)
        self.assertEqual((m["kind"], m["world_size"], m["shard_world"], m["sharding"]), ("sharded", 3, 3, "FULL_SHARD"))
        src = read_meta(self.sharded)
        for key in ("optimizer", "loss_scaler", "align_elems", "checksum"):
            self.assertEqual(m[key], src[key], key)

    def test_a_no_shard_source_becomes_a_full_shard_layout(self):
        # A NO_SHARD job saves one shard file; resharded to 3 files, the metadata must describe the
        # 3-shard FULL_SHARD layout the tool wrote, not the source's strategy.
        src, dst = self.path("no_shard"), self.path("no_shard_world3")
        gathered = maker("make", src, "-", "--sharding", "NO_SHARD")
        self.assertEqual((read_meta(src)["shard_world"], read_meta(src)["sharding"]), (1, "NO_SHARD"))
        self.assertRc(tool("reshard", "--world", "3", src, dst), 0)
        m = read_meta(dst)
        self.assertEqual((m["world_size"], m["shard_world"], m["sharding"]), (3, 3, "FULL_SHARD"))
        self.assertLoads(dst, 3, gathered)

    def test_loads_at_world_3_and_1(self):
        self.assertLoads(self.out, 3, self.gathered)
        self.assertLoads(self.out, 1, self.gathered)

    def test_output_verifies(self):
        r = tool("verify", self.out)
        self.assertRc(r, 0)

    def test_shards_hold_the_layout_the_metadata_gives(self):
        # Rebuilds every param from the three shard files by hand.
        m = read_meta(self.out)
        align = m["align_elems"]
        shards = []
        for s in range(3):
            _, tensors = read_safetensors(os.path.join(self.out, "shard-%05d-of-00003.safetensors" % s))
            shards.append({n: raw for n, _, _, raw in tensors})
        for u, unit in enumerate(m["units"]):
            self.assertEqual(unit["padded_numel"] % (3 * align), 0)
            flat = []
            for s in range(3):
                flat += bits(shards[s]["units.%d.param" % u])
                for st in STATES:
                    self.assertEqual(len(shards[s]["units.%d.%s" % (u, st)]), unit["padded_numel"] // 3 * 4)
            self.assertEqual(len(flat), unit["padded_numel"])
            covered = set()
            for p in unit["params"]:
                self.assertEqual(p["offset"] % align, 0)
                self.assertEqual(flat[p["offset"]:p["offset"] + p["numel"]], self.gathered[p["name"]], p["name"])
                covered.update(range(p["offset"], p["offset"] + p["numel"]))
            for i, b in enumerate(flat):
                if i not in covered:
                    self.assertEqual(b, "00000000", "padding element %d of unit %d" % (i, u))

    def test_optimizer_state_survives(self):
        self.assertLoads(self.out, 2, maker("load", self.sharded, 2, "--step"), "--step")

    def test_bad_world_is_a_usage_error(self):
        for args in [["--world", "0"], ["--world=0"], ["--world", "-1"], ["--world", "x"], ["--world", "3.5"],
                     ["--world", "99999999999999999999"], []]:
            dst = self.path("bad_world")
            r = tool("reshard", *args, self.sharded, dst)
            self.assertRc(r, 2)
            self.assertNoDir(dst)

    def test_full_to_world_4_is_the_library_sharded_save(self):
        out = self.path("from_full")
        self.assertRc(tool("reshard", "--world=4", self.full, out), 0)
        self.assertEqual(dir_bytes(out), dir_bytes(self.sharded))

    def test_world_1_and_5(self):
        one, five = self.path("world1"), self.path("world5")
        self.assertRc(tool("reshard", "--world", "1", self.out, one), 0)
        self.assertRc(tool("reshard", self.full, five, "--world", "5"), 0)
        self.assertLoads(one, 4, self.gathered)
        self.assertLoads(five, 2, self.gathered)

    def test_corrupt_source_exits_1_and_leaves_no_destination(self):
        src = self.copy(self.full, "corrupt_full")
        f = os.path.join(src, "optimizer.safetensors")
        off, n = tensor_offset(f, "head.bias.exp_avg_sq")
        flip_byte(f, off + n - 2)
        dst = self.path("from_corrupt")
        r = tool("reshard", "--world", "2", src, dst)
        self.assertRc(r, 1)
        self.assertIn(f, r.stderr)
        self.assertIn("head.bias.exp_avg_sq", r.stderr)
        self.assertNoDir(dst)

    def test_duplicate_param_names_reshard(self):
        src, dst = self.path("dup_sharded"), self.path("dup_world2")
        gathered = maker("make", src, "-", "--dup-names")
        self.assertRc(tool("reshard", "--world", "2", src, dst), 0)
        self.assertLoads(dst, 2, gathered, "--dup-names")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--maker", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("group", choices=["cli", "inspect", "verify", "consolidate", "reshard"])
    args = ap.parse_args()
    global TOOL, MAKER, WORK
    TOOL, MAKER, WORK = os.path.abspath(args.tool), os.path.abspath(args.maker), os.path.abspath(args.work)
    os.makedirs(WORK, exist_ok=True)
    case = {"cli": Cli, "inspect": Inspect, "verify": Verify, "consolidate": Consolidate, "reshard": Reshard}[args.group]
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(case)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
