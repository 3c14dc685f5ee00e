// Metrics: Prometheus text, histograms, JSON lines, and the HTTP endpoint on loopback.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/metrics/metrics.h"

using namespace diloco;

TEST_CASE("counters, gauges and labels render as Prometheus text", "[metrics]") {
  Metrics m("diloco_test_");
  m.add("deltas_sent_total", 2);
  m.add("deltas_sent_total", 3);
  m.set("loss", 2.5);
  m.add("dropped_total", 1, {{"reason", "too_stale"}});
  m.add("dropped_total", 4, {{"reason", "superseded"}});
  CHECK(m.value("deltas_sent_total") == 5);
  CHECK(m.value("dropped_total", {{"reason", "superseded"}}) == 4);
  CHECK(m.value("never_set") == 0);
  std::string text = m.prometheus_text();
  CHECK_THAT(text, Catch::Contains("# TYPE diloco_test_deltas_sent_total counter\ndiloco_test_deltas_sent_total 5\n"));
  CHECK_THAT(text, Catch::Contains("# TYPE diloco_test_loss gauge\ndiloco_test_loss 2.5\n"));
  CHECK_THAT(text, Catch::Contains("diloco_test_dropped_total{reason=\"superseded\"} 4\n"));
  CHECK_THAT(text, Catch::Contains("diloco_test_dropped_total{reason=\"too_stale\"} 1\n"));
}

TEST_CASE("histograms are cumulative with +Inf, sum and count", "[metrics]") {
  Metrics m("x_");
  for (double v : {0.0, 1.0, 1.5, 3.0, 10.0}) m.observe("staleness", v, {0, 1, 2});
  std::string text = m.prometheus_text();
  CHECK_THAT(text, Catch::Contains("x_staleness_bucket{le=\"0\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("x_staleness_bucket{le=\"1\"} 2\n"));
  CHECK_THAT(text, Catch::Contains("x_staleness_bucket{le=\"2\"} 3\n"));
  CHECK_THAT(text, Catch::Contains("x_staleness_bucket{le=\"+Inf\"} 5\n"));
  CHECK_THAT(text, Catch::Contains("x_staleness_sum 15.5\n"));
  CHECK_THAT(text, Catch::Contains("x_staleness_count 5\n"));
  auto snap = m.snapshot();
  CHECK(snap["staleness"]["count"] == 5);
}

TEST_CASE("JSON lines: one parseable object per line, appended", "[metrics]") {
  std::string path = "/tmp/diloco-metrics-test-" + std::to_string(::getpid()) + ".jsonl";
  std::remove(path.c_str());
  {
    JsonLines out(path);
    out.write({{"step", 1}, {"loss", 3.5}});
    out.write({{"step", 2}, {"loss", 3.0}});
  }
  JsonLines(path).write({{"step", 3}});
  std::ifstream in(path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    CHECK(j["step"] == ++n);
  }
  CHECK(n == 3);
  std::remove(path.c_str());
  CHECK_THROWS_AS(JsonLines("/nonexistent-dir/x.jsonl"), IoError);
}

TEST_CASE("the endpoint serves /metrics on loopback and refuses a taken port", "[metrics]") {
  Metrics m("ep_");
  m.set("version", 7, {{"fragment", "0"}});
  int port = 0;
  std::unique_ptr<MetricsEndpoint> endpoint;
  for (int candidate = 39100; candidate < 39200 && !endpoint; ++candidate) {
    try {
      endpoint = std::make_unique<MetricsEndpoint>(m, candidate);
      port = candidate;
    } catch (const IoError&) {
    }
  }
  REQUIRE(endpoint);
  httplib::Client client("127.0.0.1", port);
  auto response = client.Get("/metrics");
  REQUIRE(response);
  CHECK(response->status == 200);
  CHECK_THAT(response->body, Catch::Contains("ep_version{fragment=\"0\"} 7"));
  CHECK_THROWS_WITH(MetricsEndpoint(m, port), Catch::Contains("--metrics-port"));
}
