// decoupled_diloco._core: the learner runtime (learner/runtime.h) and the rebuild of a version
// from a run's logs (tools/replay/replay.h) for Python, with nanobind. No torch is linked or
// imported: tensors arrive as fp32 C-contiguous CPU arrays through DLPack or the buffer protocol
// (a PyTorch CPU tensor, a NumPy array, a pinned host copy of a GPU tensor), and the runtime reads
// and writes their memory in place. The typed, documented face is decoupled_diloco/session.py.
//
// The GIL is released for every runtime call, so the runtime's waits never hold up other Python
// threads. Python runs only in the callbacks (host copies of device tensors, and the stop check of
// long waits, which runs the interpreter's signal handlers so that Ctrl-C ends a wait), each of
// which takes the GIL back for its call. A Python exception raised in a callback or by a signal
// handler ends the runtime call and is raised again to the caller.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config_json.h"
#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/fragments/partition.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"
#include "core/metrics/metrics.h"
#include "core/process.h"
#include "learner/runtime.h"
#include "tools/replay/replay.h"

namespace nb = nanobind;
using namespace diloco;

namespace {

using HostArray = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

// The package's exception classes (decoupled_diloco/errors.py), looked up once at import.
struct ErrorTypes {
  nb::object invalid_input, unavailable, io, internal;
};
ErrorTypes& error_types() {
  static ErrorTypes types;
  return types;
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_run_config(path, overrides);
}

LearnerMode parse_mode(const std::string& mode) {
  if (mode == "train") return LearnerMode::Train;
  if (mode == "eval") return LearnerMode::EvalOnly;
  if (mode == "no-publish") return LearnerMode::NoPublish;
  if (mode == "standalone") return LearnerMode::Standalone;
  throw InvalidInput("mode must be one of train, eval, no-publish, standalone, not '" + mode + "'");
}

KafkaOptions kafka_options(const std::string& bootstrap, double connect_timeout_s, const std::string& client_id) {
  KafkaOptions kafka;
  kafka.bootstrap_servers = bootstrap;
  kafka.connect_timeout_ms = static_cast<int>(connect_timeout_s * 1000);
  kafka.client_id = client_id;
  return kafka;
}

// The runtime with the Python objects it reads and calls kept alive beside it.
class Runtime {
 public:
  Runtime(const std::string& config_path, const std::vector<std::string>& overrides, const std::vector<std::string>& names,
          const std::vector<std::vector<int64_t>>& shapes, std::vector<std::optional<HostArray>> buffers, nb::object to_host,
          nb::object from_host, const nb::dict& options)
      : buffers_(std::move(buffers)), to_host_(std::move(to_host)), from_host_(std::move(from_host)) {
    if (names.size() != shapes.size() || names.size() != buffers_.size())
      throw InvalidInput("names, shapes and buffers must be lists of the same length");
    RuntimeOptions o;
    o.config = load_config(config_path, overrides);
    auto get = [&](const char* key) -> nb::handle { return options.contains(key) ? options[key] : nb::handle(); };
    auto text = [&](const char* key, std::string fallback) {
      nb::handle v = get(key);
      return v.is_valid() && !v.is_none() ? nb::cast<std::string>(v) : fallback;
    };
    auto number = [&](const char* key, double fallback) {
      nb::handle v = get(key);
      return v.is_valid() && !v.is_none() ? nb::cast<double>(v) : fallback;
    };
    o.mode = parse_mode(text("mode", "train"));
    o.learner_id = text("learner_id", "");
    o.region = text("region", "");
    o.kafka = kafka_options(text("bootstrap", default_bootstrap_servers()), number("connect_timeout", 30), o.learner_id);
    o.run_dir = text("run_dir", "");
    o.spill_dir = text("spill_dir", "");
    o.metrics_port = static_cast<int>(number("metrics_port", 0));
    o.index = static_cast<uint32_t>(number("index", 0));
    o.learners = static_cast<uint32_t>(number("learners", 1));
    o.steps = static_cast<int64_t>(number("total_steps", 0));
    o.batch = static_cast<uint32_t>(number("batch", 0));
    o.context = static_cast<uint32_t>(number("context", 0));
    o.log_every = static_cast<int>(number("log_every", 10));
    o.heartbeat_interval_s = number("heartbeat_interval", o.heartbeat_interval_s);
    o.genesis_timeout = std::chrono::seconds(static_cast<int64_t>(number("genesis_timeout", 600)));
    o.id_claim_wait_s = number("id_claim_wait", o.id_claim_wait_s);
    o.shutdown_flush = std::chrono::milliseconds(static_cast<int64_t>(number("shutdown_flush", 10) * 1000));
    o.client = text("client", "python");
    if (nb::handle endpoints = get("merger_endpoints"); endpoints.is_valid() && !endpoints.is_none())
      o.merger_endpoints = nb::cast<std::vector<std::string>>(endpoints);
    if (nb::handle fragments = get("fragments"); fragments.is_valid() && !fragments.is_none())
      o.fragments = nb::cast<std::vector<uint32_t>>(fragments);
    o.should_stop = [this] { return interrupted(); };

    std::vector<RegisteredTensor> tensors;
    for (size_t i = 0; i < names.size(); ++i) {
      int64_t numel = 1;
      for (int64_t d : shapes[i]) numel *= d;
      if (!buffers_[i]) {  // a tensor of no fragment this learner takes part in (the runtime checks)
        tensors.push_back(RegisteredTensor{names[i], shapes[i], nullptr});
        continue;
      }
      if (static_cast<int64_t>(buffers_[i]->size()) != numel)
        throw InvalidInput("tensor '" + names[i] + "': its buffer holds " + std::to_string(buffers_[i]->size()) +
                           " values, its shape " + std::to_string(numel));
      tensors.push_back(RegisteredTensor{names[i], shapes[i], buffers_[i]->data()});
    }
    HostSync sync;
    if (!to_host_.is_none()) sync.to_host = [this](std::span<const uint32_t> t) { call(to_host_, t); };
    if (!from_host_.is_none()) sync.from_host = [this](std::span<const uint32_t> t) { call(from_host_, t); };
    runtime_ = std::make_unique<LearnerRuntime>(std::move(o), std::move(tensors), std::move(sync));
  }

  // A session dropped without close() flushes its deltas here (up to shutdown_flush): without
  // the GIL, so other Python threads go on meanwhile.
  ~Runtime() {
    if (nb::is_alive()) {
      nb::gil_scoped_release release;
      runtime_.reset();
    }
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  bool start() {
    bool ok;
    {
      nb::gil_scoped_release release;
      ok = runtime_->start();
    }
    raise_pending();
    return ok;
  }

  void step(uint64_t tokens, std::optional<float> loss, std::optional<double> seconds) {
    {
      nb::gil_scoped_release release;
      runtime_->step({.tokens = tokens, .loss = loss, .seconds = seconds});
    }
    raise_pending();
  }

  size_t poll() {
    size_t adopted;
    {
      nb::gil_scoped_release release;
      adopted = runtime_->poll();
    }
    raise_pending();
    return adopted;
  }

  void record_eval(double loss) { runtime_->record_eval(loss); }

  void close(const std::string& reason) {
    {
      nb::gil_scoped_release release;
      runtime_->close(reason);
    }
    raise_pending();
  }

  nb::bytes save_state() const {
    const auto bytes = runtime_->save_state();
    return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

  void load_state(nb::bytes bytes) {
    const auto* data = static_cast<const uint8_t*>(bytes.data());
    std::vector<uint8_t> copy(data, data + bytes.size());
    {
      nb::gil_scoped_release release;
      runtime_->load_state(copy);
    }
    raise_pending();
  }

  const LearnerRuntime& runtime() const { return *runtime_; }
  LearnerRuntime& runtime() { return *runtime_; }

 private:
  // Runs with the GIL released; takes it for the Python call.
  void call(const nb::object& callback, std::span<const uint32_t> tensors) {
    nb::gil_scoped_acquire gil;
    nb::list indices;
    for (uint32_t t : tensors) indices.append(t);
    callback(indices);  // a Python exception propagates as nb::python_error through the runtime
  }

  // The stop check of the runtime's waits: runs the interpreter's signal handlers; an exception
  // one raises (KeyboardInterrupt) ends the wait and is raised again when the call returns.
  bool interrupted() {
    nb::gil_scoped_acquire gil;
    if (pending_) return true;
    if (PyErr_CheckSignals() != 0) {
      pending_.emplace();  // fetches the exception the handler raised
      return true;
    }
    return false;
  }

  void raise_pending() {
    if (!pending_) return;
    nb::python_error e = std::move(*pending_);
    pending_.reset();
    throw e;
  }

  std::vector<std::optional<HostArray>> buffers_;
  nb::object to_host_, from_host_;
  std::optional<nb::python_error> pending_;
  std::unique_ptr<LearnerRuntime> runtime_;
};

// Every tensor of the run's model at a version, rebuilt from the logs as diloco-replay rebuild
// does: {name: float32 array}, and facts about it.
nb::tuple rebuild_model(const std::string& config_path, const std::vector<std::string>& overrides, const std::string& bootstrap,
                  std::optional<uint64_t> version, double connect_timeout_s, double timeout_s) {
  std::vector<FragmentState> states;
  std::shared_ptr<const FragmentLayout> layout;
  std::string run_id;
  {
    nb::gil_scoped_release release;
    ReplayOptions o{.config_file = config_path, .overrides = overrides,
                    .kafka = kafka_options(bootstrap, connect_timeout_s, "decoupled-diloco-load"),
                    .timeout_ms = static_cast<int>(timeout_s * 1000), .threads = 1};
    ReplayRun run = open_run(o);
    states = rebuild_states(run, version.value_or(UINT64_MAX));
    layout = run.layout;
    run_id = run.config.run.id;
  }
  nb::dict versions, checksums;
  for (const auto& state : states) {
    versions[nb::int_(state.fragment)] = state.version;
    checksums[nb::int_(state.fragment)] = state.checksum;
  }
  nb::dict tensors;
  for (auto& t : named_tensors(*layout, states)) {
    auto* values = new std::vector<float>(std::move(t.values));
    nb::capsule owner(values, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
    std::vector<size_t> shape(t.shape.begin(), t.shape.end());
    tensors[nb::str(t.name.c_str())] = nb::ndarray<nb::numpy, float>(values->data(), shape.size(), shape.data(), owner);
  }
  nb::dict info;
  info["run_id"] = run_id;
  info["fingerprint"] = layout->fingerprint;
  info["versions"] = versions;
  info["checksums"] = checksums;
  nb::list order;
  for (const auto& spec : layout->tensors) order.append(nb::str(spec.name.c_str()));
  info["tensors"] = order;
  return nb::make_tuple(tensors, info);
}

void translate(const std::exception_ptr& p, void*) {
  auto raise = [](const nb::object& type, const char* what) { PyErr_SetString(type.ptr(), what); };
  try {
    std::rethrow_exception(p);
  } catch (const InvalidInput& e) {
    raise(error_types().invalid_input, e.what());
  } catch (const Unavailable& e) {
    raise(error_types().unavailable, e.what());
  } catch (const IoError& e) {
    raise(error_types().io, e.what());
  } catch (const Error& e) {
    raise(error_types().internal, e.what());
  }
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "The native learner runtime of decoupled_diloco (see decoupled_diloco.Session).";
  nb::module_ errors = nb::module_::import_("decoupled_diloco.errors");
  error_types() = {errors.attr("InvalidInputError"), errors.attr("UnavailableError"), errors.attr("StorageError"),
                   errors.attr("DilocoError")};
  nb::register_exception_translator(translate);

  nb::class_<Runtime>(m, "Runtime")
      .def(nb::init<const std::string&, const std::vector<std::string>&, const std::vector<std::string>&,
                    const std::vector<std::vector<int64_t>>&, std::vector<std::optional<HostArray>>, nb::object, nb::object,
                    const nb::dict&>(),
           nb::arg("config"), nb::arg("overrides"), nb::arg("names"), nb::arg("shapes"), nb::arg("buffers"),
           nb::arg("to_host").none(), nb::arg("from_host").none(), nb::arg("options"))
      .def("start", &Runtime::start)
      .def("step", &Runtime::step, nb::arg("tokens"), nb::arg("loss").none(), nb::arg("seconds").none())
      .def("poll", &Runtime::poll)
      .def("record_eval", &Runtime::record_eval, nb::arg("loss"))
      .def("close", &Runtime::close, nb::arg("reason"))
      .def("save_state", &Runtime::save_state)
      .def("load_state", &Runtime::load_state, nb::arg("state"))
      .def_prop_ro("step_count", [](const Runtime& r) { return r.runtime().step_count(); })
      .def_prop_ro("tokens", [](const Runtime& r) { return r.runtime().tokens(); })
      .def_prop_ro("versions", [](const Runtime& r) { return r.runtime().versions(); })
      .def_prop_ro("fingerprint", [](const Runtime& r) { return r.runtime().fingerprint(); })
      .def_prop_ro("started", [](const Runtime& r) { return r.runtime().started(); })
      .def_prop_ro("closed", [](const Runtime& r) { return r.runtime().closed(); })
      .def_prop_ro("run_id", [](const Runtime& r) { return r.runtime().options().config.run.id; })
      .def_prop_ro("fragments",
                   [](const Runtime& r) {
                     std::vector<std::vector<std::string>> out;
                     for (const auto& fragment : r.runtime().layout().fragments) {
                       out.emplace_back();
                       for (const auto& spec : fragment) out.back().push_back(spec.name);
                     }
                     return out;
                   })
      .def("metric", [](Runtime& r, const std::string& name) { return r.runtime().metrics().value(name); },
           nb::arg("name"));

  m.def("rebuild", &rebuild_model, nb::arg("config"), nb::arg("overrides"), nb::arg("bootstrap"), nb::arg("version").none(),
        nb::arg("connect_timeout"), nb::arg("timeout"));
  m.def(
      "resolved_config",
      [](const std::string& path, const std::vector<std::string>& overrides) {
        return run_config_json(load_config(path, overrides)).dump();
      },
      nb::arg("config"), nb::arg("overrides"));
  m.def("default_bootstrap", &default_bootstrap_servers);
  // The tensors (indices, model order) that hold values of the given fragments of the layout the
  // config gives these tensors: those a learner of these fragments needs host buffers for.
  m.def(
      "tensors_of_fragments",
      [](const std::string& path, const std::vector<std::string>& overrides, const std::vector<std::string>& names,
         const std::vector<std::vector<int64_t>>& shapes, const std::vector<uint32_t>& fragments) {
        if (names.size() != shapes.size()) throw InvalidInput("names and shapes must be lists of the same length");
        std::vector<TensorSpec> specs;
        for (size_t i = 0; i < names.size(); ++i) specs.push_back(TensorSpec{names[i], shapes[i]});
        const FragmentLayout layout = partition_tensors(specs, load_config(path, overrides).diloco.fragments);
        std::vector<bool> used(names.size(), false);
        for (uint32_t p : fragments) {
          if (p >= layout.num_fragments())
            throw InvalidInput("fragment " + std::to_string(p) + " is not in the layout (fragments 0 to " +
                               std::to_string(layout.num_fragments() - 1) + ")");
          for (const auto& piece : layout.pieces[p]) used[piece.tensor] = true;
        }
        std::vector<uint32_t> out;
        for (uint32_t t = 0; t < used.size(); ++t)
          if (used[t]) out.push_back(t);
        return out;
      },
      nb::arg("config"), nb::arg("overrides"), nb::arg("names"), nb::arg("shapes"), nb::arg("fragments"));
  m.def(
      "create_topics",
      [](const std::string& bootstrap, const std::string& run_id, const std::vector<std::string>& regions, int partitions) {
        nb::gil_scoped_release release;
        const KafkaOptions kafka = kafka_options(bootstrap, 30, "decoupled-diloco-topics");
        wait_for_broker(kafka);
        create_topics(kafka,
                      run_topic_specs(builtin_topic_definitions(), run_id, regions, partitions, kafka.max_message_bytes),
                      30000);
      },
      nb::arg("bootstrap"), nb::arg("run_id"), nb::arg("regions"), nb::arg("partitions"),
      "Creates the topics of a run that do not exist yet (broker_config/topics.def), as scripts/broker topics does.");
}
