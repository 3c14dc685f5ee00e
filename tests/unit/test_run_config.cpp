// Run config: TOML sections, defaults, strict keys and types, command-line overrides.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/config/run_config.h"
#include "core/errors.h"

using namespace diloco;
using Catch::Matchers::Contains;

TEST_CASE("an empty file gives the defaults", "[config]") {
  const RunConfig c = parse_run_config("", "empty.toml");
  CHECK(c.run.id == RunConfig{}.run.id);
  CHECK(c.model.width == ModelConfig{}.width);
  CHECK(c.codec.dtype == DType::INT4);
  CHECK_NOTHROW(validate_run_config(c));
}

TEST_CASE("every section and key is read", "[config]") {
  const RunConfig c = parse_run_config(R"(
[run]
id = "exp-1"
seed = 42
[model]
layers = 3
width = 96
heads = 6
context = 32
[train]
batch = 8
lr = 1e-3
weight_decay = 0
warmup_steps = 10
total_steps = 500
eval_every = 50
eval_batches = 4
grad_clip = 0.5
[diloco]
fragments = 3
H = 30
adopt = "overwrite"
blend_alpha = 0.5
[codec]
dtype = "int8"
block_size = 128
byte_shuffle = false
zstd_level = 9
[data]
path = "/tmp/kjv.txt"
split = "region"
heldout_fraction = 0.1
)",
                                       "full.toml");
  CHECK(c.run.id == "exp-1");
  CHECK(c.run.seed == 42);
  CHECK(c.model.layers == 3);
  CHECK(c.model.width == 96);
  CHECK(c.model.heads == 6);
  CHECK(c.model.context == 32);
  CHECK(c.train.batch == 8);
  CHECK(c.train.lr == Approx(1e-3));
  CHECK(c.train.weight_decay == 0.0);  // an integer is accepted for a float field
  CHECK(c.train.warmup_steps == 10);
  CHECK(c.train.total_steps == 500);
  CHECK(c.train.eval_every == 50);
  CHECK(c.train.eval_batches == 4);
  CHECK(c.train.grad_clip == Approx(0.5));
  CHECK(c.diloco.fragments == 3);
  CHECK(c.diloco.H == 30);
  CHECK(c.diloco.blend_alpha == Approx(0.5));
  CHECK(c.codec.dtype == DType::INT8);
  CHECK(c.codec.block_size == 128);
  CHECK_FALSE(c.codec.byte_shuffle);
  CHECK(c.codec.zstd_level == 9);
  CHECK(c.data.path == "/tmp/kjv.txt");
  CHECK(c.data.split == DataSplit::region);
  CHECK(c.data.heldout_fraction == Approx(0.1));
  CHECK_NOTHROW(validate_run_config(c));
}

TEST_CASE("unknown keys and sections are errors naming the key and the file", "[config]") {
  CHECK_THROWS_WITH(parse_run_config("[model]\nlayers = 2\nlayrs = 3\n", "cfg.toml"),
                    Contains("cfg.toml:3") && Contains("model.layrs") && Contains("unknown key"));
  CHECK_THROWS_WITH(parse_run_config("[modle]\nlayers = 2\n", "cfg.toml"),
                    Contains("cfg.toml") && Contains("modle") && Contains("unknown section"));
  CHECK_THROWS_WITH(parse_run_config("seed = 2\n", "cfg.toml"),
                    Contains("cfg.toml") && Contains("seed"));
  CHECK_THROWS_AS(parse_run_config("[model]\nlayrs = 3\n", "cfg.toml"), InvalidInput);
}

TEST_CASE("wrong types are clear errors", "[config]") {
  CHECK_THROWS_WITH(parse_run_config("[model]\nlayers = \"two\"\n", "cfg.toml"),
                    Contains("cfg.toml:2") && Contains("model.layers") &&
                        Contains("expected an integer") && Contains("string"));
  CHECK_THROWS_WITH(parse_run_config("[train]\nlr = \"fast\"\n", "cfg.toml"),
                    Contains("train.lr") && Contains("expected a number"));
  CHECK_THROWS_WITH(parse_run_config("[codec]\nbyte_shuffle = 1\n", "cfg.toml"),
                    Contains("codec.byte_shuffle") && Contains("boolean"));
  CHECK_THROWS_WITH(parse_run_config("[codec]\ndtype = \"int3\"\n", "cfg.toml"),
                    Contains("codec.dtype"));
  CHECK_THROWS_WITH(parse_run_config("[data]\nsplit = \"random\"\n", "cfg.toml"),
                    Contains("data.split") && Contains("iid or region"));
  CHECK_THROWS_WITH(parse_run_config("[diloco]\nfragments = -1\n", "cfg.toml"),
                    Contains("diloco.fragments"));
  CHECK_THROWS_WITH(parse_run_config("[run]\nseed = -5\n", "cfg.toml"), Contains("run.seed"));
  CHECK_THROWS_WITH(parse_run_config("[model]\nlayers = 2.5\n", "cfg.toml"),
                    Contains("model.layers"));
}

TEST_CASE("TOML syntax errors carry the file and line", "[config]") {
  CHECK_THROWS_WITH(parse_run_config("[model]\nlayers = = 2\n", "cfg.toml"),
                    Contains("cfg.toml:2"));
}

TEST_CASE("overrides set one field each, with the field's type", "[config]") {
  RunConfig c;
  apply_override(c, "train.lr=3e-4");
  apply_override(c, "model.layers=6");
  apply_override(c, "data.split=region");         // bare word: taken as a string
  apply_override(c, "data.path=\"/a b/c.txt\"");  // quoted TOML string
  apply_override(c, "codec.byte_shuffle=false");
  apply_override(c, "run.id=run-7");
  apply_override(c, "diloco.H=24");
  CHECK(c.train.lr == Approx(3e-4));
  CHECK(c.model.layers == 6);
  CHECK(c.data.split == DataSplit::region);
  CHECK(c.data.path == "/a b/c.txt");
  CHECK_FALSE(c.codec.byte_shuffle);
  CHECK(c.run.id == "run-7");
  CHECK(c.diloco.H == 24);

  CHECK_THROWS_WITH(apply_override(c, "model.layers=many"),
                    Contains("model.layers=many") && Contains("expected an integer"));
  CHECK_THROWS_WITH(apply_override(c, "model.depth=3"), Contains("model.depth"));
  CHECK_THROWS_WITH(apply_override(c, "nosection=3"), Contains("section.key=value"));
  CHECK_THROWS_WITH(apply_override(c, "model.layers"), Contains("section.key=value"));
  CHECK(c.model.layers == 6);
}

TEST_CASE("validation checks ranges and constraints between fields", "[config]") {
  const auto invalid = [](std::string_view override_text) {
    RunConfig c;
    apply_override(c, override_text);
    validate_run_config(c);
  };
  CHECK_THROWS_WITH(invalid("model.width=65"), Contains("model.width") && Contains("heads"));
  CHECK_THROWS_WITH(invalid("diloco.H=10"), Contains("diloco.H") && Contains("fragments"));
  CHECK_THROWS_WITH(invalid("diloco.blend_alpha=1.0"), Contains("blend_alpha"));
  CHECK_THROWS_WITH(invalid("diloco.adopt=merge"), Contains("diloco.adopt") && Contains("rebase"));
  {
    RunConfig c;
    apply_override(c, "diloco.adopt=rebase");
    CHECK(c.diloco.adopt == "rebase");
    CHECK_NOTHROW(validate_run_config(c));
    apply_override(c, "diloco.blend_alpha=0.5");
    CHECK_THROWS_WITH(validate_run_config(c), Contains("blend_alpha") && Contains("rebase"));
  }
  CHECK_THROWS_WITH(invalid("train.batch=0"), Contains("train.batch"));
  CHECK_THROWS_WITH(invalid("train.warmup_steps=5000"), Contains("warmup_steps"));
  CHECK_THROWS_WITH(invalid("data.heldout_fraction=0"), Contains("heldout_fraction"));
  CHECK_THROWS_WITH(invalid("run.id=\"a.b\""), Contains("run.id"));
  CHECK_THROWS_AS(invalid("codec.zstd_level=0"), InvalidInput);
  CHECK_THROWS_WITH(invalid("codec.downlink_block_size=0"), Contains("codec.downlink_block_size must be between 1"));
  CHECK_THROWS_WITH(invalid("codec.downlink_block_size=2000000"), Contains("codec.downlink_block_size"));
  CHECK_THROWS_WITH(invalid("codec.chunk_bytes=100"), Contains("codec.chunk_bytes must be between 4096"));
  CHECK_THROWS_WITH(invalid("codec.topk=64"), Contains("codec.topk") && Contains("below the block size"));
  CHECK_THROWS_WITH(invalid("codec.downlink_topk=64"), Contains("codec.downlink_topk") && Contains("below the block size"));
  CHECK_NOTHROW(invalid("codec.topk=63"));
  CHECK_NOTHROW(invalid("codec.chunk_bytes=4096"));
  CHECK_THROWS_WITH(invalid("codec.segment_bytes=4095"), Contains("codec.segment_bytes must be between 4096"));
  CHECK_THROWS_WITH(invalid("codec.segment_bytes=1073741825"), Contains("2 GiB"));
  CHECK_NOTHROW(invalid("codec.segment_bytes=1073741824"));
}

TEST_CASE("load_run_config reads a file, applies overrides, validates", "[config]") {
  const auto path = std::filesystem::temp_directory_path() /
                    ("diloco_test_run_config_" + std::to_string(getpid()) + ".toml");
  {
    std::ofstream out(path);
    out << "[model]\nlayers = 3\n[diloco]\nfragments = 2\nH = 20\n";
  }
  const std::vector<std::string> overrides{"model.layers=4", "train.batch=2"};
  const RunConfig c = load_run_config(path, overrides);
  CHECK(c.model.layers == 4);
  CHECK(c.train.batch == 2);
  CHECK(c.diloco.fragments == 2);
  CHECK_THAT(c.source, Contains(path.string()) && Contains("model.layers=4"));

  const std::vector<std::string> bad{"diloco.H=21"};
  CHECK_THROWS_WITH(load_run_config(path, bad), Contains(path.string()) && Contains("diloco.H"));
  std::filesystem::remove(path);
  CHECK_THROWS_AS(load_run_config(path), IoError);
}

TEST_CASE("the shipped configs load and validate", "[config]") {
  for (const char* name : {"tiny", "demo", "bench"}) {
    const auto path =
        std::filesystem::path(DILOCO_SOURCE_DIR) / "configs" / (std::string(name) + ".toml");
    INFO(path);
    CHECK_NOTHROW(load_run_config(path));
  }
}

TEST_CASE("the diloco section: schedule phase, cut before an overwrite and synchronous waits", "[config]") {
  RunConfig c = parse_run_config("", "empty");
  CHECK_FALSE(c.diloco.stagger);
  CHECK(c.diloco.cut_on_arrival == 0.5);
  CHECK(c.diloco.adopt == "rebase");
  CHECK(c.diloco.wait_steps == -1);
  CHECK(c.diloco.wait_timeout_seconds == Approx(300));
  RunConfig d = parse_run_config(R"(
[diloco]
stagger = true
cut_on_arrival = 0.25
wait_steps = 0
wait_timeout_seconds = 30
)",
                                 "d.toml");
  CHECK(d.diloco.stagger);
  CHECK(d.diloco.cut_on_arrival == Approx(0.25));
  CHECK(d.diloco.wait_steps == 0);
  CHECK(d.diloco.wait_timeout_seconds == Approx(30));
  CHECK_NOTHROW(validate_run_config(d));
  apply_override(d, "diloco.wait_steps=5");
  apply_override(d, "diloco.cut_on_arrival=1");  // an integer for a fraction
  CHECK(d.diloco.wait_steps == 5);
  CHECK(d.diloco.cut_on_arrival == 1.0);
  CHECK_NOTHROW(validate_run_config(d));

  CHECK_THROWS_WITH(parse_run_config("[diloco]\nstagger = 1\n", "d.toml"),
                    Contains("d.toml:2: diloco.stagger: expected a boolean"));
  CHECK_THROWS_WITH(parse_run_config("[diloco]\nwait_steps = 0.5\n", "d.toml"),
                    Contains("diloco.wait_steps: expected an integer"));
  const auto invalid = [](std::string_view override_text) {
    RunConfig e;
    apply_override(e, override_text);
    validate_run_config(e);
  };
  CHECK_THROWS_WITH(invalid("diloco.wait_steps=-2"), Contains("diloco.wait_steps (-2) must be -1"));
  CHECK_THROWS_WITH(invalid("diloco.cut_on_arrival=1.5"), Contains("diloco.cut_on_arrival (1.5) must be in [0, 1]"));
  CHECK_THROWS_WITH(invalid("diloco.cut_on_arrival=-0.1"), Contains("diloco.cut_on_arrival"));
  CHECK_THROWS_WITH(invalid("diloco.wait_timeout_seconds=0"), Contains("diloco.wait_timeout_seconds must be positive"));
  CHECK_THROWS_WITH(invalid("diloco.wiat_steps=1"), Contains("diloco.wiat_steps"));
}

TEST_CASE("the merger section: defaults, overrides and range checks", "[config]") {
  RunConfig c = parse_run_config("", "empty");
  CHECK(c.merger.quorum == 1);
  CHECK(c.merger.outer_lr == Approx(1.0));
  CHECK(c.merger.outer_momentum == Approx(0.5));
  CHECK(c.merger.rule == "rda");
  CHECK(c.merger.max_staleness == -1);
  CHECK(c.merger.share_scaling);
  apply_override(c, "merger.share_scaling=false");
  CHECK_FALSE(c.merger.share_scaling);
  apply_override(c, "merger.quorum=3");
  apply_override(c, "merger.rule=avg");
  CHECK(c.merger.quorum == 3);
  CHECK(c.merger.rule == "avg");
  validate_run_config(c);
  apply_override(c, "merger.rule=median");
  CHECK_THROWS_WITH(validate_run_config(c), Catch::Contains("merger.rule must be \"rda\" or \"avg\""));
  RunConfig d = parse_run_config("", "empty");
  apply_override(d, "merger.outer_momentum=1.0");
  CHECK_THROWS_WITH(validate_run_config(d), Catch::Contains("merger.outer_momentum must be in [0, 1)"));
  CHECK_THROWS_WITH(parse_run_config("[merger]\nquorom = 2\n", "m.toml"), Catch::Contains("merger.quorom"));
  for (const char* bad : {"0.5", "-1"}) {
    RunConfig e = parse_run_config("", "empty");
    apply_override(e, std::string("merger.max_norm_ratio=") + bad);
    CHECK_THROWS_WITH(validate_run_config(e), Catch::Contains("merger.max_norm_ratio must be 0 (no bound) or at least 1"));
  }
  for (const char* good : {"0", "1", "250"}) {
    RunConfig e = parse_run_config("", "empty");
    apply_override(e, std::string("merger.max_norm_ratio=") + good);
    CHECK_NOTHROW(validate_run_config(e));
  }
}

TEST_CASE("the merger's outer optimizers: names, their settings and their checks", "[config]") {
  RunConfig c = parse_run_config("", "empty");
  CHECK(c.merger.optimizer == "nesterov");
  CHECK(c.merger.dn_period == 2);
  CHECK(c.merger.dn_activation == 0);
  CHECK(c.merger.cgad_decay == Approx(0.1));
  CHECK(c.merger.cgad_cutoff == 16);
  CHECK(c.merger.adam_beta2 == Approx(0.99));
  CHECK(c.merger.adam_epsilon == Approx(1e-8));
  c = parse_run_config(R"(
[merger]
optimizer = "dn"
dn_period = 32
dn_activation = 0.25
cgad_decay = 0.2
cgad_cutoff = 8
adam_beta2 = 0.95
adam_epsilon = 1e-6
)", "m.toml");
  validate_run_config(c);
  CHECK(c.merger.optimizer == "dn");
  CHECK(c.merger.dn_period == 32);
  CHECK(c.merger.dn_activation == Approx(0.25));
  CHECK(c.merger.cgad_decay == Approx(0.2));
  CHECK(c.merger.cgad_cutoff == 8);
  CHECK(c.merger.adam_beta2 == Approx(0.95));
  CHECK(c.merger.adam_epsilon == Approx(1e-6));
  apply_override(c, "merger.optimizer=cgad");
  validate_run_config(c);
  apply_override(c, "merger.optimizer=adam");
  CHECK_THROWS_WITH(validate_run_config(c),
                    Catch::Contains("merger.optimizer must be one of nesterov, sgd, dn, cgad, not \"adam\""));
  for (const char* bad : {"merger.dn_period=0", "merger.dn_activation=1.5", "merger.cgad_decay=-1",
                          "merger.cgad_cutoff=0", "merger.adam_beta2=1.0", "merger.adam_epsilon=0.0"}) {
    RunConfig d = parse_run_config("", "empty");
    apply_override(d, bad);
    INFO(bad);
    CHECK_THROWS_AS(validate_run_config(d), InvalidInput);
  }
}

TEST_CASE("the cluster section: arrays of regions and speed factors, checked element by element", "[config]") {
  RunConfig c = parse_run_config(R"(
[cluster]
learners = 4
regions = ["eu", "us", "asia"]
mergers = 2
speed_factors = [1, 1.5, 2.0]
eval_interval = 5
schedule_by_speed = true
)",
                                 "c.toml");
  CHECK(c.cluster.learners == 4);
  CHECK(c.cluster.regions == std::vector<std::string>{"eu", "us", "asia"});
  CHECK(c.cluster.mergers == 2);
  CHECK(c.cluster.speed_factors == std::vector<double>{1.0, 1.5, 2.0});
  CHECK(c.cluster.eval_interval == Approx(5));
  CHECK(c.cluster.schedule_by_speed);
  CHECK_FALSE(RunConfig{}.cluster.schedule_by_speed);
  CHECK_NOTHROW(validate_run_config(c));
  apply_override(c, "cluster.regions=[\"a\"]");
  CHECK(c.cluster.regions == std::vector<std::string>{"a"});
  CHECK_THROWS_WITH(parse_run_config("[cluster]\nregions = [\"eu\", 3]\n", "c.toml"),
                    Contains("c.toml:2: cluster.regions[1]: expected a string"));
  CHECK_THROWS_WITH(parse_run_config("[cluster]\nregions = \"eu\"\n", "c.toml"), Contains("expected an array"));
  RunConfig bad = parse_run_config("[cluster]\nspeed_factors = [0.5]\n", "c.toml");
  CHECK_THROWS_WITH(validate_run_config(bad), Contains("cluster.speed_factors: 0.5 must be in [1, 1000]"));
  RunConfig bad_region = parse_run_config("[cluster]\nregions = [\"e u\"]\n", "c.toml");
  CHECK_THROWS_WITH(validate_run_config(bad_region), Contains("cluster.regions: \"e u\""));
}

TEST_CASE("the outer momentum's schedule: keys, defaults and checks", "[config]") {
  RunConfig c = parse_run_config("", "empty");
  CHECK(c.merger.momentum_warmup == 0);
  CHECK(c.merger.momentum_decay_to == 0);
  apply_override(c, "merger.momentum_warmup=8");
  apply_override(c, "merger.momentum_decay_from=20");
  apply_override(c, "merger.momentum_decay_to=40");
  apply_override(c, "merger.momentum_final=0.6");
  CHECK(c.merger.momentum_warmup == 8);
  CHECK(c.merger.momentum_decay_from == 20);
  CHECK(c.merger.momentum_decay_to == 40);
  CHECK(c.merger.momentum_final == Approx(0.6));
  validate_run_config(c);
  apply_override(c, "merger.optimizer=dn");
  CHECK_NOTHROW(validate_run_config(c));
  for (const char* other : {"sgd", "cgad"}) {
    RunConfig e = c;
    apply_override(e, std::string("merger.optimizer=") + other);
    CHECK_THROWS_WITH(validate_run_config(e), Catch::Contains("schedule the momentum of optimizer \"nesterov\" or \"dn\""));
  }
  RunConfig d = c;
  apply_override(d, "merger.momentum_decay_to=20");  // not after decay_from
  CHECK_THROWS_WITH(validate_run_config(d), Catch::Contains("merger.momentum_decay_to (20) must be 0 (no decay) or after"));
  RunConfig e = c;
  apply_override(e, "merger.momentum_final=1");
  CHECK_THROWS_WITH(validate_run_config(e), Catch::Contains("merger.momentum_final must be in [0, 1)"));
}
