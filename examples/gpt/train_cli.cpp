// train_cli.cpp - train_gpt's command line: --help's text and the parse
// into Options (every value checked).

#include <unistd.h>

#include "train.h"

namespace train {

void usage(const char* argv0) {
  std::fprintf(
      stderr,
      "usage: %s [options]\n"
      "  --ranks N          thread-ranks of the first phase (4)\n"
      "  --resume-ranks M   thread-ranks that load its checkpoint and train on (2; 0: no second phase)\n"
      "  --steps S          optimizer steps in all (600); --switch-step K: the first phase ends at K (480)\n"
      "  --layers L --width C --heads H --context T   the GPT's shape (4, 128, 4, 128)\n"
      "  --batch B          sequences per step over all ranks (16)\n"
      "  --seed N           the init, the batches' order and the sample's draws (1234)\n"
      "  --dtype bf16|fp32  param_dtype (bf16); --sharding S (FULL_SHARD); --lr X (3e-3)\n"
      "  --device cpu|cuda[:N]  where the ranks compute (cpu; cuda: the GPU GPT, bf16, one GPU shared by\n"
      "                     the thread-ranks, or one GPU per process under torchrun/mpirun)\n"
      "  --recompute        drop each block's activations after forward, recompute them in backward\n"
      "  --graph            (--device cuda, --ranks 1 --resume-ranks 1) capture the step once in a CUDA\n"
      "                     graph and replay it (libfsdp's step stays on the device)\n"
      "  --no-bf16-shard    keep_param_dtype_shard=0: no persistent bf16 shard, cast at each gather\n"
      "  --bf16-shard       keep_param_dtype_shard=1\n"
      "  --text FILE        the corpus (examples/gpt/data/alice29.txt)\n"
      "  --ckpt DIR         where the checkpoint goes (a temporary directory, removed at the end)\n"
      "  --snapshot-every N fsdp_snapshot every N steps into --snapshot-dir DIR (/dev/shm/libfsdp-gpt-UID);\n"
      "                     run again after a kill, it resumes from the snapshot (else from --ckpt DIR);\n"
      "                     a run that ends removes it\n"
      "  --save-every N     fsdp_save_async into --ckpt DIR every N steps (the step goes on meanwhile)\n"
      "  --trace FILE       the timeline of the first phase's last 2 steps (Chrome trace JSON)\n"
      "  --plot DIR         metrics.json and trace.json into DIR, then PNGs via examples/gpt/plot.py\n"
      "                     (matplotlib; $PYTHON, else python3, runs it)\n"
      "  --print-every N (40) --eval-batches N (4) --sample N (300 bytes of text at the end)\n"
      "  --check            a small, short run that fails unless it learns and resumes exactly\n"
      "  --save DIR / --resume DIR   (under mpirun: one phase) write / load a sharded checkpoint\n"
      "  --export DIR       at the end, the params as safetensors into DIR (new or empty): the base of --lora\n"
      "  --lora R --base DIR   LoRA fine-tuning: DIR's model (an --export) frozen, rank-R adapters on every\n"
      "                     block's qkv, proj, fc and fc2 trained for --steps (--lora-alpha X: scale X/R,\n"
      "                     default 1); then one step of full fine-tuning for its memory, printed beside\n"
      "  --bench-json FILE  timing run on random bytes: 2 warm-up steps, then --steps timed; writes JSON\n",
      argv0);
}

Options parse(int argc, char** argv) {
  Options o;
  bool check_mode = false, switch_given = false;
  for (int a = 1; a < argc; ++a)
    if (!std::strcmp(argv[a], "--check")) check_mode = true;
  if (check_mode) {  // the CTest size: small and quick, still a GPT
    o.shape = {2, 64, 4, 64};
    o.steps = 40;
    o.switch_step = 30;
    o.batch = 8;
    o.print_every = 10;
    o.eval_batches = 2;
    o.sample_chars = 80;
    o.check = true;
  }
  for (int a = 1; a < argc; ++a) {
    const std::string k = argv[a];
    if (k == "--check") continue;
    if (k == "--graph") {
      o.graph = true;
      continue;
    }
    if (k == "--recompute") {
      o.recompute = true;
      continue;
    }
    if (k == "--no-bf16-shard" || k == "--bf16-shard") {  // keep_param_dtype_shard=0 / 1
      o.bf16_shard = k == "--bf16-shard" ? 1 : 0;
      continue;
    }
    if (k == "--help" || k == "-h") {
      usage(argv[0]);
      std::exit(0);
    }
    if (a + 1 >= argc) fail("option " + k + " needs a value (--help)");
    const std::string v = argv[++a];
    auto num = [&]() {
      char* end = nullptr;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (*end || v.empty()) fail("option " + k + " takes an integer, not '" + v + "'");
      return static_cast<int>(x);
    };
    if (k == "--ranks")
      o.ranks = num(), o.ranks_given = true;
    else if (k == "--resume-ranks")
      o.resume_ranks = num();
    else if (k == "--steps")
      o.steps = num();
    else if (k == "--switch-step")
      o.switch_step = num(), switch_given = true;
    else if (k == "--layers")
      o.shape.layers = num();
    else if (k == "--width")
      o.shape.width = num();
    else if (k == "--heads")
      o.shape.heads = num();
    else if (k == "--context")
      o.shape.context = num();
    else if (k == "--batch")
      o.batch = num();
    else if (k == "--print-every")
      o.print_every = num();
    else if (k == "--eval-batches")
      o.eval_batches = num();
    else if (k == "--sample")
      o.sample_chars = num();
    else if (k == "--dtype")
      o.dtype = v;
    else if (k == "--device")
      o.device = v;
    else if (k == "--sharding")
      o.sharding = v;
    else if (k == "--lr")
      o.lr = std::atof(v.c_str());
    else if (k == "--text")
      o.text = v;
    else if (k == "--ckpt")
      o.ckpt = v;
    else if (k == "--trace")
      o.trace = v;
    else if (k == "--plot")
      o.plot = v;
    else if (k == "--save")
      o.save = v;
    else if (k == "--snapshot-every")
      o.snapshot_every = num();
    else if (k == "--snapshot-dir")
      o.snapshot_dir = v;
    else if (k == "--save-every")
      o.save_every = num();
    else if (k == "--resume")
      o.resume = v;
    else if (k == "--bench-json")
      o.bench_json = v;
    else if (k == "--export")
      o.export_dir = v;
    else if (k == "--lora")
      o.lora = num();
    else if (k == "--seed")
      o.seed = static_cast<uint64_t>(num());
    else if (k == "--lora-alpha")
      o.lora_alpha = std::atof(v.c_str());
    else if (k == "--base")
      o.base = v;
    else
      fail("unknown option " + k + " (--help)");
  }
  if (!switch_given && o.switch_step >= o.steps) o.switch_step = o.steps * 4 / 5;
  const std::string why = gpt::shape_error(o.shape);
  if (!why.empty()) fail(why);
  if (o.ranks < 1 || o.ranks > 64 || o.resume_ranks < 0 || o.resume_ranks > 64) fail("--ranks must be in [1, 64]");
  if (o.steps < 1 || o.batch < 1 || o.print_every < 1 || o.eval_batches < 1)
    fail("--steps, --batch, --print-every and --eval-batches must be >= 1");
  if (o.resume_ranks > 0 && (o.switch_step < 1 || o.switch_step >= o.steps))
    fail("--switch-step must be in [1, --steps)");
  if (o.dtype != "bf16" && o.dtype != "fp32") fail("--dtype must be bf16 or fp32");
  if (o.snapshot_every < 0 || o.save_every < 0) fail("--snapshot-every and --save-every take a number of steps");
  if (o.save_every > 0 && o.ckpt.empty()) fail("--save-every N saves into --ckpt DIR: give --ckpt too");
  if (o.snapshot_dir.empty()) o.snapshot_dir = "/dev/shm/libfsdp-gpt-" + std::to_string(getuid());
  if (o.lora < 0 || o.lora > 4096) fail("--lora takes a rank in [1, 4096]");
  if (o.lora > 0) {
    if (o.lora_alpha < 0) o.lora_alpha = o.lora;
    if (o.base.empty())
      fail(
          "--lora needs --base DIR: the base model's weights, as `train_gpt --export DIR` writes them "
          "(README, 'Fine-tuning')");
  } else if (!o.base.empty()) {
    fail("--base is the frozen model of --lora R; give --lora too");
  }
  return o;
}

}  // namespace train
