"""Rollouts on llama.cpp (grpo.rollout_engine: llama_cpp), the CPU's counterpart of the vLLM
engine the GPU frameworks sample with.

The engine is a process of its own that lives for the run: it loads the policy's GGUF file
(grpo.models.gguf_writer) once, and each step the learner rewrites the weights in that file in
place, which the engine sees through its mapping. A request sends token ids and gets token ids
back: nothing is tokenized or detokenized on the way, so the trainer scores exactly the tokens
that were drawn. Each prompt is decoded once and its KV cache copied to its G sequences; then
every unfinished sequence advances in one batched decode per token. llama.cpp returns the
logits; the draw and its log-probability are the project's own (grpo.models.sampler.draw), the
same temperature, top-k and top-p as the other engines, so the recorded log mu is the quantity
the rollout correction divides by.

A crash of the engine (a segfault in native code cannot be caught in-process) ends the run
with one line naming it; `--resume` goes on from the last checkpoint.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch

from grpo.models.generate import Rollout, completion_mask
from grpo.models.gguf_writer import GGUFWeights, write_gguf, write_lora_gguf
from grpo.models.lora import fully_trained_modules, is_lora
from reward_fns.errors import UserError

INSTALL_HINT = "make install-llama-cpp (llama-cpp-python, which builds llama.cpp from source)"


GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level (the binding does not export it)


class EngineError(UserError, RuntimeError):
    """The llama.cpp engine is missing, failed a request, or died."""


def missing_reason() -> str | None:
    """Why the engine cannot start here (llama-cpp-python not installed), or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"grpo.rollout_engine llama_cpp needs llama-cpp-python: {INSTALL_HINT}"
    return None


def _shared_dir() -> str | None:
    """Memory-backed /dev/shm where there is one: the file is rewritten every step and never
    needs to reach a disk."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class LlamaCppEngine:
    """The learner's end of one rank's llama.cpp engine process.

    Args:
        model: the policy (Llama or Qwen2 family; of a LoRA policy the base weights are
            written once and each sync sends the adapters alone).
        tok: its tokenizer (the vocabulary goes into the GGUF file).
        dtype: "float32" or "float16", the precision of the engine's weight matrices.
        threads: CPU threads the engine decodes with.
        own_process: run llama.cpp in a process of its own (a crash in native code then ends
            the run in one line); False runs it in this process, for a caller that is already
            a process of its own (the async rollouts' sampler, which may not have children).
    """

    def __init__(
        self, model: torch.nn.Module, tok: Any, *, dtype: str, threads: int,
        own_process: bool = True,
    ) -> None:  # fmt: skip
        if (reason := missing_reason()) is not None:
            raise EngineError(reason)
        self.lora = is_lora(model)
        if self.lora and any(True for _ in fully_trained_modules(model)):
            raise EngineError(
                "grpo.rollout_engine llama_cpp with model.lora.train_embeddings: llama.cpp "
                "takes adapters on linear layers only; set train_embeddings=false"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="grpo-llamacpp-", dir=_shared_dir()))
        # the file is the size of the model, in memory: gone with this object or the process
        # even where close() is never reached
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.proc = None
        self.server: _Server | None = None
        self.adapters = 0  # adapter files written (each sync of a LoRA policy: a new one)
        self.sync_seconds, self.bytes_synced = 0.0, 0
        try:
            self.weights: GGUFWeights = write_gguf(model, tok, self.dir / "policy.gguf", dtype,
                                                   merged=not self.lora)  # fmt: skip
            if not own_process:
                self.server = _Server(str(self.weights.path), threads)
            else:
                self._start(threads)
            if self.lora:  # the file holds the base weights: the adapters go with a sync
                self.sync(model)
        except BaseException:
            self.close()
            raise

    def _start(self, threads: int) -> None:
        """The engine's own process, answering once its model is loaded."""
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=engine_main, args=(str(self.weights.path), child, threads),
            name="grpo-llama.cpp", daemon=True,
        )  # fmt: skip
        self.proc.start()
        child.close()
        self._call(("ready",))

    def sync(self, model: torch.nn.Module) -> float:
        """The engine samples with `model`'s current weights from its next request on;
        returns the seconds the copy took."""
        t = time.perf_counter()
        if self.lora:  # the adapters alone, as a file the engine loads in place of the last
            self.adapters += 1
            path = self.dir / f"adapter-{self.adapters}.gguf"
            self.bytes_synced = write_lora_gguf(model, path)
            self._call(("adapter", str(path)))
            if self.adapters > 1:
                (self.dir / f"adapter-{self.adapters - 1}.gguf").unlink()
        else:
            self.bytes_synced = self.weights.sync(model)
        self.sync_seconds = time.perf_counter() - t
        return self.sync_seconds

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's cost, as the step logs it."""
        return {"time/weight_sync": self.sync_seconds,
                "engine/weight_sync_mib": self.bytes_synced / 2**20}  # fmt: skip

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, num_generations: int,
        max_completion_length: int, eos_token_id: list[int], pad_token_id: int,
        temperature: float, top_p: float = 1.0, top_k: int = 0, do_sample: bool = True,
    ) -> Rollout:  # fmt: skip
        """generate.generate's contract on this engine: G completions per left-padded prompt,
        rows of one prompt contiguous, with the log-prob of each drawn token. The draws come
        from a seed taken from torch's generator, so a seeded step samples the same again."""
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)]
        seed = int(torch.randint(0, 2**62, ()).item())
        comp, logps = self._call(("generate", prompts, num_generations, max_completion_length,
                                  list(eos_token_id), pad_token_id, temperature, top_k, top_p,
                                  do_sample, seed))  # fmt: skip
        comp, logps = torch.from_numpy(comp), torch.from_numpy(logps)
        ids = prompt_ids.repeat_interleave(num_generations, 0)
        mask = prompt_mask.repeat_interleave(num_generations, 0)
        cmask, truncated = completion_mask(comp, eos_token_id)
        comp = comp.masked_fill(cmask == 0, pad_token_id)
        return Rollout(ids, mask, comp, cmask, truncated, logps * cmask, num_generations)

    def _call(self, request: tuple) -> Any:
        if self.server is not None:
            return self.server.handle(request)
        try:
            self.conn.send(request)
            status, payload = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as e:
            assert self.proc is not None
            self.proc.join(5)
            raise EngineError(
                f"the llama.cpp rollout engine (pid {self.proc.pid}) died with exit code "
                f"{self.proc.exitcode} during {request[0]!r}; `--resume` goes on from the last "
                "checkpoint"
            ) from e
        if status == "error":
            raise EngineError(f"the llama.cpp rollout engine failed {request[0]!r}: {payload}")
        return payload

    def close(self) -> None:
        """Stop the engine process and remove its file (always called, on errors too)."""
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass  # already gone: terminated below either way
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        if self.server is not None:
            self.server.close()
            self.server = None
        if hasattr(self, "weights"):
            self.weights.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the engine process ------------------------------------------------------------------


def engine_main(path: str, conn: Any, threads: int) -> None:
    """Serve requests on `conn` with the GGUF model at `path` until ("stop",) or EOF."""
    torch.set_num_threads(max(1, threads))
    try:
        server = _Server(path, threads)
    except Exception as e:  # noqa: BLE001 - reported to the learner, which ends the run with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return  # the learner is gone
        if request[0] == "stop":
            return
        try:
            conn.send(("ok", server.handle(request)))
        except Exception as e:  # noqa: BLE001 - one request failed: said to the learner
            last = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("error", f"{type(e).__name__}: {e} ({Path(last.filename).name}:"
                                f"{last.lineno})"))  # fmt: skip


class _Server:
    """llama.cpp's model and a context sized for the largest request so far."""

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc

        # llama.cpp logs every tensor it loads to stderr; only errors are kept
        @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        def log(level: int, text: bytes, _data: Any) -> None:
            if level == GGML_LOG_LEVEL_ERROR:
                os.write(2, text)

        self._log = log  # kept alive: llama.cpp calls it from native code
        lc.llama_log_set(log, None)
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.load_mode = lc.LLAMA_LOAD_MODE_MMAP  # the mapping is how weights arrive
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.ctx = None
        self.ctx_shape = (0, 0, 0)  # (sequences, cells, batch) of the current context
        self.adapter = None  # the LoRA adapter applied to every context

    def handle(self, request: tuple) -> Any:
        """One request: ("ready",), ("adapter", path) or ("generate", ...)."""
        if request[0] == "adapter":
            return self.set_adapter(request[1])
        if request[0] == "generate":
            return self.generate(*request[1:])
        return None

    def set_adapter(self, path: str) -> None:
        """Load the LoRA adapter at `path` in place of the last one."""
        lc = self.lc
        adapter = lc.llama_adapter_lora_init(self.model, path.encode())
        if not adapter:
            raise RuntimeError(f"llama.cpp could not load the adapter {path}")
        old, self.adapter = self.adapter, adapter
        if self.ctx is not None:
            self._apply_adapter()
        if old is not None:
            lc.llama_adapter_lora_free(old)

    def _apply_adapter(self) -> None:
        lc = self.lc
        adapters = (lc.llama_adapter_lora_p_ctypes * 1)(self.adapter)
        scales = (ctypes.c_float * 1)(1.0)  # the file's alpha / r is the whole scale
        if (rc := lc.llama_set_adapters_lora(self.ctx, adapters, 1, scales)) != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {rc}")

    def close(self) -> None:
        if self.adapter is not None:
            if self.ctx is not None:
                self.lc.llama_set_adapters_lora(self.ctx, None, 0, None)
            self.lc.llama_adapter_lora_free(self.adapter)
            self.adapter = None
        if self.ctx is not None:
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    def _context(self, n_seq: int, n_cells: int, n_batch: int) -> Any:
        lc = self.lc
        shape = (n_seq, n_cells, max(n_batch, n_seq))
        if self.ctx is not None and all(a <= b for a, b in zip(shape, self.ctx_shape)):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
            return self.ctx
        if self.ctx is not None:  # a larger one, never smaller than the last in any size
            lc.llama_free(self.ctx)
            shape = tuple(max(a, b) for a, b in zip(shape, self.ctx_shape))
        p = lc.llama_context_default_params()
        # one KV buffer shared by the sequences: a decode's cost then follows the sequences
        # still decoding; with a buffer per sequence, a decode of only some of them was slower
        # than one of all (benchmarks/ENGINE.md)
        p.n_seq_max, p.n_ctx, p.kv_unified = n_seq, n_cells, True
        p.n_batch = p.n_ubatch = shape[2]
        p.n_threads = p.n_threads_batch = self.threads
        p.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_cells} cells")
        self.ctx_shape = shape
        if self.adapter is not None:
            self._apply_adapter()
        return self.ctx

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """One llama_decode of (token, position, sequence, wants logits) entries; the logits
        of the entries that want them, in order [n, V]."""
        import numpy as np

        lc = self.lc
        batch = lc.llama_batch_init(len(entries), 0, 1)
        try:
            for i, (tok, pos, seq, out) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, out
            batch.n_tokens = len(entries)
            if (rc := lc.llama_decode(self.ctx, batch)) != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lc.llama_batch_free(batch)
        n_out = sum(e[3] for e in entries)
        ptr = lc.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy())

    def generate(
        self, prompts: list[list[int]], g: int, max_new: int, eos: list[int], pad: int,
        temperature: float, top_k: int, top_p: float, do_sample: bool, seed: int,
    ) -> tuple[Any, Any]:  # fmt: skip
        from grpo.models.sampler import draw

        lc = self.lc
        torch.manual_seed(seed)
        n = len(prompts) * g
        longest = max(len(p) for p in prompts)
        ctx = self._context(n, n * (longest + max_new), sum(len(p) for p in prompts))
        memory = lc.llama_get_memory(ctx)
        # each prompt once, into the first of its G sequences; then its cache copied
        entries = [(t, j, i * g, j == len(p) - 1) for i, p in enumerate(prompts)
                   for j, t in enumerate(p)]  # fmt: skip
        logits = self._decode(entries).repeat_interleave(g, 0)  # [n, V]
        for i in range(len(prompts)):
            for k in range(1, g):
                lc.llama_memory_seq_cp(memory, i * g, i * g + k, -1, -1)
        out = torch.full((n, max_new), pad, dtype=torch.long)
        logps = torch.zeros(n, max_new, dtype=torch.float32)
        rows = torch.arange(n)  # the sequences still decoding
        pos = torch.tensor([len(prompts[r // g]) for r in range(n)])
        eos_t = torch.tensor(eos)
        steps = 0
        for step in range(max_new):
            steps = step + 1
            tok, lp = draw(logits, temperature, top_k, top_p, do_sample)
            out[rows, step], logps[rows, step] = tok, lp
            going = ~torch.isin(tok, eos_t)
            rows, tok = rows[going], tok[going]
            if not rows.numel() or step + 1 == max_new:
                break
            logits = self._decode([(int(t), int(pos[r]) + step, int(r), True)
                                   for t, r in zip(tok, rows)])  # fmt: skip
        return out[:, :steps].numpy(), logps[:, :steps].numpy()
