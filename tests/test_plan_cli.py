"""axonn-plan CLI: JSON output, table, errors as one stderr line with exit code 2; `local`."""
import json
import subprocess
import sys

import pytest

from axonn.plan.calibrate import get_hardware
from axonn.plan.cli import main

BASE = ["--model", "llama-8b", "--gpus", "16", "--hardware", "h100", "--seq", "2048",
        "--global-batch", "32"]


def test_json_is_sorted_best_first(capsys):
    assert main(BASE + ["--json", "--top", "5"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert 1 <= len(rows) <= 5
    for key in ("x", "y", "z", "data", "time_s", "memory_gb", "tflops_per_gpu"):
        assert all(key in r for r in rows)
    assert [r["time_s"] for r in rows] == sorted(r["time_s"] for r in rows)
    assert all(r["x"] * r["y"] * r["z"] * r["data"] == 16 and r["fits"] for r in rows)


def test_table_and_flags(capsys):
    assert main(BASE + ["--top", "3", "--no-overlap", "--checkpoint-activations"]) == 0
    out = capsys.readouterr().out
    assert "time_s" in out and "PF/s" in out and "overlap off" in out
    assert len([ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]) == 3


@pytest.mark.parametrize("argv,needle", [
    (["--model", "nope", "--gpus", "8"], "model='nope'"),
    (["--model", "tiny", "--gpus", "8", "--hardware", "tpu"], "hardware='tpu'"),
    (["--model", "tiny", "--gpus", "6", "--gpus-per-node", "4"], "gpus=6"),
    (["--model", "llama-405b", "--gpus", "8", "--seq", "4096", "--global-batch", "8"], "fits"),
    (["--model", "tiny", "--gpus", "8", "--top", "0"], "top=0"),
    (["--gpus", "8"], "--model"),
    (["--model", "tiny", "--gpus", "eight"], "--gpus"),
    (["--model", "tiny", "--gpus", "8", "--loss-chunk", "0"], "--loss-chunk=0"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("axonn-plan: error:")


def test_the_lm_head_setting_is_the_trainers(capsys):
    """--loss-chunk defaults to the trainer's `auto`; each setting gives what the planner predicts for a
    run with that trainer.loss_chunk (memory differs by the head's logits, nothing else changes)."""
    from axonn.plan import get_hardware, load_shape, plan

    argv = ["--model", "llama-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "8", "--json",
            "--top", "50", "--micro-batch", "1", "--checkpoint-activations"]
    got = {}
    for setting in (None, "auto", "off", "2048"):
        assert main(argv + ([] if setting is None else ["--loss-chunk", setting])) == 0
        rows = json.loads(capsys.readouterr().out)
        got[setting] = {(r["x"], r["y"], r["z"], r["data"]): r["memory_gb"] for r in rows}
    assert got[None] == got["auto"]
    want = plan(load_shape("llama-8b"), 8, None, 4096, 8, get_hardware("h100"), checkpoint=True,
                micro_batch=1, loss_chunk="off")
    assert got["off"] == {(r.x, r.y, r.z, r.data): r.memory_gb for r in want[:50]}
    y1 = (1, 1, 8, 1)  # the whole vocabulary on one rank: chunking saves most of its [T, V] logits
    assert got["auto"][y1] < got["off"][y1] and got["2048"][y1] < got["off"][y1]


def test_model_from_hf_config_file(tmp_path, capsys):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
           "intermediate_size": 128, "vocab_size": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["--model", str(tmp_path), "--gpus", "4", "--seq", "16", "--global-batch", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "axonn.plan", "--model", "gpt-5b", "--gpus", "8",
                        "--json", "--top", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 1


def test_local_profile_reads_the_cache(cache_dir):
    cal = {"version": 2, "host": "h", "cpus": 2, "matmul_flops": 4e10, "gemm_half_dim": 6.0, "copy_bw": 2e9,
           "allreduce_bw": 4e8, "allreduce_lat": 1e-4, "memory_bytes": 8 * 2**30,
           "measured_at": "then"}
    path = cache_dir / "plan" / "local.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(cal))
    hw = get_hardware("local")
    assert hw.peak_flops == 4e10 and hw.gpus_per_node == 2 and hw.memory_bytes == 4 * 2**30
    assert hw.gemm_half_dim == 6.0 and not hw.hides_comm  # gloo moves bytes on the compute cores
    assert main(["--model", "tiny", "--gpus", "2", "--hardware", "local", "--seq", "64",
                 "--global-batch", "4"]) == 0


@pytest.mark.slow
def test_local_calibration_measures(cache_dir):
    hw = get_hardware("local", recalibrate=True)
    assert hw.peak_flops > 1e8 and hw.intra_bw > 1e6
    assert (cache_dir / "plan" / "local.json").is_file()


@pytest.mark.parametrize("half", [0.5, 5.0, 32.0, 300.0])
def test_calibration_recovers_the_gemm_half_dimension(half):
    from axonn.plan.calibrate import fit_half_dim
    from axonn.plan.compute import shape_factor

    ratio = shape_factor(16, 256, 256, half) / shape_factor(256, 256, 256, half)
    assert fit_half_dim(ratio, 256, 16) == pytest.approx(half, rel=1e-6)
    assert fit_half_dim(1.2, 256, 16) < 0.01  # a thin GEMM as fast as a big one: no penalty


def test_overlap_hides_nothing_where_collectives_share_the_compute_cores():
    import dataclasses

    from axonn.plan.model import predict
    from axonn.plan.shapes import load_shape
    from axonn.plan.volumes import Grid

    shape, grid = load_shape("llama-1b"), Grid(2, 2, 2, 1)
    gpu = get_hardware("h100")
    cpu_like = dataclasses.replace(gpu, hides_comm=False)
    hidden = predict(shape, grid, 2048, 8, gpu)
    exposed = predict(shape, grid, 2048, 8, cpu_like)
    assert hidden.exposed_comm_s < hidden.comm_s
    assert exposed.exposed_comm_s == exposed.comm_s and exposed.time_s > hidden.time_s


def test_runnable_grids_rank_first_and_a_hint_when_none(capsys):
    """Grids the engine runs as is (z*data divides the batch) come before faster uneven ones; with none
    runnable one line names a global batch that gives some (README's headline example runs)."""
    argv = ["--model", "llama-405b", "--gpus", "6144", "--gpus-per-node", "4", "--hardware", "alps-h100",
            "--seq", "4096"]
    assert main(argv + ["--global-batch", "1024", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "none of these grids runs as is" in out and "--global-batch 1152 with --strict" in out
    assert main(argv + ["--global-batch", "1152", "--strict", "--top", "1"]) == 0
    capsys.readouterr()
    assert main(argv + ["--global-batch", "1536", "--json", "--top", "400"]) == 0
    rows = json.loads(capsys.readouterr().out)
    even = [r["even_batch"] for r in rows if r["fits"]]
    assert even == sorted(even, reverse=True) and even[0]


def test_lora_plans_what_a_lora_run_runs(capsys):
    """70B on one 8 x H100 node: a full fine-tune fits nowhere, the LoRA run (frozen bf16 base, rank-16
    adapters; only they carry gradients and AdamW state) fits, as its dry run says."""
    argv = ["--model", "llama-70b", "--gpus", "8", "--hardware", "h100", "--seq", "2048",
            "--global-batch", "8"]
    assert main(argv) == 2
    assert "plan a LoRA run (--lora R)" in capsys.readouterr().err
    assert main(argv + ["--lora", "16", "--json", "--top", "1"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["fits"] and best["memory_gb"] < 72
    assert main(argv + ["--lora", "0"]) == 2 and "rank must be >= 1" in capsys.readouterr().err
    assert main(argv + ["--lora-targets", "q_proj"]) == 2 and "needs --lora" in capsys.readouterr().err
