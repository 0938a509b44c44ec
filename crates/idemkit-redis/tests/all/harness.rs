//! Starts throwaway `redis-server` processes on free loopback ports in a temp
//! dir: a single node, or a Redis Cluster of three primaries with one replica
//! each. A Drop guard kills them and removes the directory. Std only, so the
//! failover benchmark includes this file too.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Free loopback ports, all distinct (the listeners are held until all are chosen).
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-redis-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `redis-cli -p port args…` and returns its stdout.
pub(crate) fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `INFO <section>` as a map.
pub(crate) fn info(port: u16, section: &str) -> BTreeMap<String, String> {
    cli(port, &["INFO", section])
        .lines()
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One server process.
pub(crate) struct Node {
    pub(crate) port: u16,
    child: Option<Child>,
    dir: PathBuf,
    extra: Vec<String>,
}

impl Node {
    fn start(dir: &Path, port: u16, extra: &[&str]) -> Self {
        let dir = dir.join(port.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let mut node = Self {
            port,
            child: None,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        node.spawn();
        node
    }

    /// Starts a killed node again with the same settings (and, in a cluster,
    /// its `nodes.conf`: it rejoins, as a replica once its slots were taken over).
    pub(crate) fn restart(&mut self) {
        assert!(self.child.is_none(), "node {} is running", self.port);
        self.spawn();
    }

    fn spawn(&mut self) {
        let (port, dir) = (self.port, &self.dir);
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args([
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                // Start a replica's full sync at once (the default waits 5 s to batch replicas).
                "--repl-diskless-sync-delay",
                "0",
                "--daemonize",
                "no",
            ])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        wait_until(
            &format!("redis-server on {port}"),
            Duration::from_secs(10),
            || cli(port, &["PING"]).trim() == "PONG",
        );
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal (`STOP`, `CONT`, `KILL`) with `kill(1)`.
    pub(crate) fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status();
        }
    }

    /// SIGKILL and reap.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A standalone server (for tests that kill it, or a clean `INFO commandstats`).
pub(crate) struct Standalone {
    pub(crate) node: Node,
    dir: PathBuf,
}

impl Standalone {
    pub(crate) fn start(extra: &[&str]) -> Self {
        let dir = temp_dir("single");
        let port = free_ports(1)[0];
        Self {
            node: Node::start(&dir, port, extra),
            dir,
        }
    }

    pub(crate) fn url(&self) -> String {
        self.node.url()
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        self.node.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster: three primaries, one replica each, on loopback.
pub(crate) struct Cluster {
    pub(crate) nodes: Vec<Node>,
    dir: PathBuf,
}

/// A node's role as `CLUSTER NODES` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Role {
    pub(crate) port: u16,
    pub(crate) id: String,
    pub(crate) master: bool,
    /// For a replica: its primary's id.
    pub(crate) master_id: Option<String>,
}

impl Cluster {
    /// Starts six nodes and creates the cluster; waits until every node reports
    /// `cluster_state:ok` and every replica's link is up.
    pub(crate) fn start() -> Self {
        let dir = temp_dir("cluster");
        let ports = free_ports(12);
        let nodes: Vec<Node> = (0..6)
            .map(|i| {
                let bus = ports[6 + i].to_string();
                Node::start(
                    &dir,
                    ports[i],
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                        "--cluster-port",
                        &bus,
                        // Keep serving the healthy slots while one shard fails over.
                        "--cluster-require-full-coverage",
                        "no",
                    ],
                )
            })
            .collect();
        let mut cluster = Self { nodes, dir };
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// Waits until every live node reports `cluster_state:ok` and sees three
    /// primaries, each with a replica whose link is up.
    pub(crate) fn wait_healthy(&mut self, timeout: Duration) {
        wait_until("a healthy cluster", timeout, || {
            let live: Vec<u16> = self.live_ports();
            live.iter()
                .all(|&p| cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                && live.iter().all(|&p| {
                    let i = info(p, "replication");
                    i.get("role").map(String::as_str) != Some("slave")
                        || i.get("master_link_status").map(String::as_str) == Some("up")
                })
                && live.iter().all(|&p| {
                    let roles = Self::roles_at(p);
                    let masters: Vec<&Role> = roles.iter().filter(|r| r.master).collect();
                    masters.len() == 3
                        && masters.iter().all(|m| {
                            roles
                                .iter()
                                .any(|r| r.master_id.as_deref() == Some(m.id.as_str()))
                        })
                })
        });
    }

    /// Waits until every live node serves all 16384 slots from a reachable primary.
    pub(crate) fn wait_serving(&self, timeout: Duration) {
        wait_until("all slots served", timeout, || {
            self.live_ports().iter().all(|&p| {
                let i = cli(p, &["CLUSTER", "INFO"]);
                i.contains("cluster_state:ok")
                    && i.contains("cluster_slots_fail:0")
                    && i.contains("cluster_slots_ok:16384")
            })
        });
    }

    pub(crate) fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(Node::url)
            .collect()
    }

    /// Roles as seen from the node on `port`.
    pub(crate) fn roles_at(port: u16) -> Vec<Role> {
        cli(port, &["CLUSTER", "NODES"])
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() < 8 || f[2].contains("fail") || f[2].contains("noaddr") {
                    return None;
                }
                let port = f[1].split(['@', ',']).next()?.rsplit(':').next()?.parse().ok()?;
                let master = f[2].contains("master");
                Some(Role {
                    port,
                    id: f[0].to_owned(),
                    master,
                    master_id: (!master && f[3] != "-").then(|| f[3].to_owned()),
                })
            })
            .collect()
    }

    /// The primaries' ports and, for each, its replica's port.
    pub(crate) fn pairs(&self) -> Vec<(u16, u16)> {
        let roles = Self::roles_at(self.live_ports()[0]);
        roles
            .iter()
            .filter(|r| r.master)
            .filter_map(|m| {
                roles
                    .iter()
                    .find(|r| r.master_id.as_deref() == Some(&m.id))
                    .map(|r| (m.port, r.port))
            })
            .collect()
    }

    /// The hash slot of `key`, as the cluster computes it.
    pub(crate) fn keyslot(&self, key: &str) -> u16 {
        cli(self.live_ports()[0], &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("keyslot")
    }

    pub(crate) fn node(&self, port: u16) -> &Node {
        self.nodes.iter().find(|n| n.port == port).expect("node")
    }

    pub(crate) fn node_mut(&mut self, port: u16) -> &mut Node {
        self.nodes.iter_mut().find(|n| n.port == port).expect("node")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
