//! A seed-era client's view of ServerEvent: every stdin line must decode; prints each.
use serde::Deserialize;
use std::io::BufRead;

#[derive(Debug, Deserialize)]
struct TokenChunk {
    text: String,
    ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
enum ErrorKind {
    Invalid,
    ModelNotLoaded,
    Rejected,
    Cancelled,
    Internal,
}

#[derive(Debug, Deserialize)]
enum ServerEvent {
    Accepted { request_id: String, queue_position: u32 },
    Tokens { request_id: String, chunk: TokenChunk, finished: bool },
    FleetDescription(serde_json::Value),
    Error { request_id: String, kind: ErrorKind, message: String },
}

fn main() {
    let stdin = std::io::stdin();
    for (n, line) in stdin.lock().lines().enumerate() {
        let line = line.expect("stdin");
        match serde_json::from_str::<ServerEvent>(&line) {
            Ok(event) => println!("{:?}", event),
            Err(err) => {
                eprintln!("line {}: {}: {}", n + 1, err, line);
                std::process::exit(1);
            }
        }
    }
}
