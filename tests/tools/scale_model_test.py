#!/usr/bin/env python3
"""Checks scripts/scale_model.py: its JSON has every field, the counts its replay
produces are the ones each scheme implies (N^2 pipes and N(N-1)/2 Gloo pairs for
eager init, none for the others; connections after first use follow the call pattern),
the closed-form bound it uses for runs too large to replay counts exactly what the
replay counts, and bad arguments exit 2 naming the argument.

    python3 tests/tools/scale_model_test.py [path/to/scale_model.py]
"""

import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.environ.get("SCALE_MODEL", os.path.join(HERE, "..", "..", "scripts", "scale_model.py"))

FIELDS = ["scheme", "workers", "hosts", "pattern", "simulated", "init_ms", "first_use_ms", "store_requests",
          "store_requests_per_worker_max", "store_values_served", "store_bytes_served", "store_busy_ms",
          "store_utilization", "parked_peak", "connections_init", "connections_after_first_use", "gloo_pairs"]


def run(*args, check=True):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=100)
    if check and p.returncode != 0:
        raise AssertionError(f"scale_model.py {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p


def results(*args):
    return json.loads(run(*args, "--json").stdout)["studies"][0]["results"]


class ScaleModelTest(unittest.TestCase):
    def test_quick_studies_have_every_field(self):
        out = json.loads(run("--quick", "--json").stdout)
        self.assertEqual(len(out["studies"]), 4)
        for study in out["studies"]:
            self.assertTrue(study["title"])
            self.assertIn("op_us", study["params"])
            self.assertTrue(study["results"])
            for r in study["results"]:
                for f in FIELDS:
                    self.assertIn(f, r, f"{study['title']}: {r}")
                for f in FIELDS[5:]:
                    self.assertGreaterEqual(r[f], 0, f"{f} in {r}")
                self.assertGreaterEqual(r["first_use_ms"], r["init_ms"] * 0.999, r)
        text = run("--quick").stdout
        self.assertIn("| scheme | N | hosts | init |", text)
        self.assertNotIn("issue", text.lower())

    def test_eager_init_connects_everyone_and_the_rest_connect_on_use(self):
        for r in results("--workers", "2,8,16", "--schemes", "eager,table,lazy"):
            n = r["workers"]
            self.assertTrue(r["simulated"])
            self.assertEqual(r["connections_after_first_use"], n * n, r)  # all-to-all, self included
            if r["scheme"] == "eager":
                self.assertEqual(r["connections_init"], n * n, r)
                self.assertEqual(r["gloo_pairs"], n * (n - 1) // 2, r)
                # Gloo: every worker waits for and reads every other worker's key.
                self.assertEqual(r["store_requests"], n * (2 * (n - 1) + 7) + 1, r)
            else:
                self.assertEqual(r["connections_init"], 0, r)
                self.assertEqual(r["gloo_pairs"], 0, r)
            if r["scheme"] == "table":
                # set, add, wait, multi_get; the last to arrive also sets "done"
                self.assertEqual(r["store_requests"], 4 * n + 1, r)
                self.assertEqual(r["store_requests_per_worker_max"], 5 if n > 1 else 4, r)
                self.assertEqual(r["store_values_served"], n * n, r)

    def test_eager_init_time_grows_with_n(self):
        times = [r["init_ms"] for r in results("--workers", "2,8,16", "--schemes", "eager")]
        self.assertLess(times[0], times[1])
        self.assertLess(times[1], times[2])

    def test_connections_follow_the_call_pattern(self):
        n, s = 32, 4
        for r in results("--workers", str(n), "--per-host", "4", "--cores", "8", "--shards", "2",
                         "--pattern", f"ps:{s}", "--schemes", "table,lazy,hier"):
            self.assertEqual(r["connections_after_first_use"], (n - s) * s, r)
            self.assertEqual(r["hosts"], 8)
        ring = results("--workers", "16", "--pattern", "ring", "--schemes", "lazy")[0]
        self.assertEqual(ring["connections_after_first_use"], 16)
        self.assertEqual(ring["store_values_served"], 16)  # one lookup per worker

    def test_per_host_aggregation_touches_the_store_per_host_not_per_worker(self):
        by = {r["scheme"]: r for r in results("--workers", "64", "--per-host", "8", "--cores", "32",
                                               "--shards", "4", "--pattern", "ps:16",
                                               "--schemes", "table,lazy,hier")}
        self.assertLess(by["hier"]["store_requests"], by["lazy"]["store_requests"])
        self.assertLess(by["hier"]["store_requests"], by["table"]["store_requests"])
        self.assertLess(by["lazy"]["store_values_served"], by["table"]["store_values_served"])

    def test_bound_counts_what_the_replay_counts(self):
        common = ["--workers", "24", "--per-host", "4", "--cores", "8", "--shards", "2", "--pattern", "ps:5"]
        for scheme in ("eager", "lazy", "hier"):
            replayed = results(*common, "--schemes", scheme)[0]
            bounded = results(*common, "--schemes", scheme, "--max-requests", "0")[0]
            self.assertTrue(replayed["simulated"])
            self.assertFalse(bounded["simulated"])
            for f in ("store_requests", "store_values_served", "store_bytes_served", "connections_init",
                      "connections_after_first_use", "gloo_pairs", "store_requests_per_worker_max"):
                self.assertEqual(bounded[f], replayed[f], f"{scheme}: {f}")
            # Server work alone is a lower bound on the replayed time.
            self.assertLessEqual(bounded["store_busy_ms"], replayed["store_busy_ms"] * 1.0001 + 1e-6, scheme)

    def test_bad_arguments_exit_2_naming_them(self):
        for args, says in ((["--workers", "0"], "--workers"), (["--workers", "a,b"], "--workers"),
                           (["--pattern", "star"], "--pattern"), (["--schemes", "eager,mesh"], "--schemes"),
                           (["--cores", "0"], "--cores")):
            p = run(*args, check=False)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(says, p.stderr, args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        SCRIPT = sys.argv.pop(1)
    unittest.main()
