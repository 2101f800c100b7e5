"""Compare per-round acceptance: SafeAILab eagenerate (out_eagle.json) vs reval's eval (results.json).

reval's acceptance_lengths are A+1 per round (A accepted drafts + the target's token); eagenerate's logged
accept_length is A. A round starting at committed position p (y[p] = the round's bonus token) is fully covered by
the cache when p + max_drafts <= N-1 (max_drafts = K for the chain, depth+1 for the tree); otherwise reval's walk
can accept at most N-1-p drafts (censored tail), and the round is compared as min(A_theirs, N-1-p).
"""
import json
import sys


def main(eagle_json, chain_results, tree_results):
    ref = json.load(open(eagle_json))
    total = {"full": [0, 0], "censored": [0, 0]}
    lines = []
    for mode, path in (("chain", chain_results), ("tree", tree_results)):
        setup = ref["setups"][mode]
        max_drafts = setup["depth"] + 1
        ours = {p["name"]: p for p in json.load(open(path))["per_prompt"]}
        for name, r in setup["prompts"].items():
            o = ours[name]
            n, N = o["prompt_len"], o["seq_len"]
            assert r["tokens"][:N] == r["cache_ids"][:N], f"{mode} {name}: eagenerate output != cached completion"
            theirs = r["accept"]
            mine = [a - 1 for a in o["acceptance_lengths"]]
            p, first_diff, eq_full, n_full, eq_cens, n_cens = n, None, 0, 0, 0, 0
            for i, a_mine in enumerate(mine):
                if i >= len(theirs):
                    first_diff = first_diff or (i, p, a_mine, None)
                    break
                censored = p + max_drafts > N - 1
                want = min(theirs[i], N - 1 - p) if censored else theirs[i]
                ok = a_mine == want
                if censored:
                    n_cens += 1
                    eq_cens += ok
                else:
                    n_full += 1
                    eq_full += ok
                if not ok and first_diff is None:
                    first_diff = (i, p, a_mine, theirs[i])
                p += a_mine + 1
            total["full"][0] += eq_full
            total["full"][1] += n_full
            total["censored"][0] += eq_cens
            total["censored"][1] += n_cens
            lines.append(f"{mode:5s} {name:11s} full rounds {eq_full}/{n_full} equal, censored tail {eq_cens}/{n_cens}"
                         f" | ours A {mine} | eagenerate A {theirs}"
                         + (f" | FIRST DIFF round {first_diff[0]} at p={first_diff[1]}: ours {first_diff[2]}"
                            f" theirs {first_diff[3]}" if first_diff else ""))
    print("\n".join(lines))
    print(f"TOTAL fully covered rounds equal: {total['full'][0]}/{total['full'][1]}; "
          f"censored tail rounds equal (within the cache bound): {total['censored'][0]}/{total['censored'][1]}")
    return 0 if total["full"][0] == total["full"][1] and total["censored"][0] == total["censored"][1] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
