"""tools/ncu_kernel_table.py: the per-kernel table of a decode step and the side-by-side
comparison of a bench's kinds of forward, from Nsight Compute's CSV."""
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ncu_kernel_table.py"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def launch(i, name, grid, ns):
    return (f'"{i}","1","dflash","h","{name}","1","13","(128, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","ns","{ns:,}"')


def csv_text():
    lines = ["| bench output that is not CSV |", HEADER]
    i = 0
    # Two decode steps (argmax grid 1), two verify forwards (grid 16), then a trailing launch.
    for grid, att_ns, extra in [("(1, 1, 1)", 8000, 0), ("(1, 1, 1)", 9000, 0),
                                ("(16, 1, 1)", 11000, 1), ("(16, 1, 1)", 12000, 1)]:
        for name, ns in [("rms_norm", 3000), ("attention", att_ns), ("rms_norm", 3400)]:
            lines.append(launch(i, name, "(1, 1, 1)", ns))
            i += 1
        if extra:
            lines.append(launch(i, "head", "(3072, 2, 1)", 90_000))
            i += 1
        lines.append(launch(i, "argmax_final", grid, 2500))
        i += 1
    lines.append(launch(i, "rms_norm", "(1, 1, 1)", 1_000_000))
    return "\n".join(lines) + "\n"


def run(args, text):
    return subprocess.run([sys.executable, str(TOOL), *args], input=text, text=True,
                          capture_output=True)


def test_forwards_compares_the_median_forward_of_each_kind():
    r = run(["--forwards"], csv_text())
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "- argmax grid (1, 1, 1), 4 launches, 2 forwards: 17.9 us of kernels"
    assert out[1] == "- argmax grid (16, 1, 1), 5 launches, 2 forwards: 110.9 us of kernels"
    rows = {line.split(" | ")[0][2:]: line for line in out if line.startswith("| ") and "---" not in line}
    assert rows["head"] == "| head |  | 1 x 90.00 = 90.0 |"
    assert rows["attention"] == "| attention | 1 x 9.00 = 9.0 | 1 x 12.00 = 12.0 |"
    assert rows["rms_norm"] == "| rms_norm | 2 x 3.40 = 6.4 | 2 x 3.40 = 6.4 |"
    # Ordered by the largest total in any kind; the trailing launch after the last argmax is not counted.
    assert [line.split(" | ")[0][2:] for line in out[4:]] == ["head", "attention", "rms_norm", "argmax_final"]


def test_forwards_needs_a_kind_seen_twice():
    text = "\n".join([HEADER, launch(0, "attention", "(1, 1, 1)", 5000),
                      launch(1, "argmax_final", "(1, 1, 1)", 2500)]) + "\n"
    r = run(["--forwards"], text)
    assert r.returncode != 0
    assert "occurs twice" in r.stderr


def test_steps_table_still_divides_by_the_steps():
    r = run(["--steps", "2"], csv_text())
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("19 launches, ")
    assert "| attention | 2 | 11.00 | 8.00 | 12.00 | 20.0 |" in r.stdout


def test_input_without_ncu_csv_is_an_error():
    r = run([], "nothing here\n")
    assert r.returncode != 0
    assert "no ncu CSV header" in r.stderr


def rounds_csv():
    """A prompt's forward, then three greedy DFlash rounds (context write, draft forward,
    drafting argmax; target forward, its argmax, the verdict), then a trailing launch."""
    lines = [HEADER]
    i = 0
    seq = [("prefill_gemm", 50_000), ("argmax_final", 2000)]
    for att_ns in (8000, 9000, 30_000):  # the round's draft attention
        seq += [("kv_write", 2000), ("draft_attention", att_ns), ("argmax_part", 3000),
                ("argmax_final", 2000), ("target_attention", 12_000), ("argmax_part", 3000),
                ("argmax_final", 2000), ("verify_finish", 1000)]
    seq.append(("kv_write", 5_000_000))
    for name, ns in seq:
        lines.append(launch(i, name, "(1, 1, 1)", ns))
        i += 1
    return "\n".join(lines) + "\n"


def test_rounds_puts_the_median_rounds_draft_part_beside_its_verify_part():
    r = run(["--rounds"], rounds_csv())
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    # Rounds of 85 (the first holds the prompt's forward), 34 and 55 us: the median is the third.
    assert out[0] == ("- 3 rounds; the median round: 55.0 us of kernels, draft part 37.0 us in 4 launches, "
                      "verify part 18.0 us in 4 launches")
    rows = {line.split(" | ")[0][2:]: line for line in out if line.startswith("| ") and "---" not in line}
    assert rows["target_attention"] == "| target_attention |  | 1 x 12.00 = 12.0 |"
    assert rows["draft_attention"] == "| draft_attention | 1 x 30.00 = 30.0 |  |"
    assert rows["argmax_part"] == "| argmax_part | 1 x 3.00 = 3.0 | 1 x 3.00 = 3.0 |"
    assert rows["verify_finish"] == "| verify_finish |  | 1 x 1.00 = 1.0 |"


def test_rounds_needs_a_verdict():
    r = run(["--rounds"], csv_text())
    assert r.returncode != 0
    assert "no DFlash round" in r.stderr


def test_rounds_cut_the_first_round_after_its_drafting_not_the_prompts_choice():
    r = run(["--rounds"], "\n".join(rounds_csv().splitlines()[:11]) + "\n")
    assert r.returncode == 0, r.stderr
    # One round: the prompt's forward and its choice count in the draft part.
    assert r.stdout.splitlines()[0] == ("- 1 rounds; the median round: 85.0 us of kernels, draft part "
                                        "67.0 us in 6 launches, verify part 18.0 us in 4 launches")
