//! NVRTC's whole log (ptxas -v info lines included, e.g. wgmma serialization advisories)
//! for one kernel: `cargo run -p dsv4-cuda --example ptxas_log -- <kernel path under
//! kernels/, or a .cu file on disk> [arch (sm_90a)] [NAME=VALUE ...]`. A file on disk is
//! compiled with the repository's headers (an old version of a kernel, say).
//! `DSV4_CUBIN_OUT=<file>` also writes the CUBIN there (for `nvdisasm -c <file>`).
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().expect("a kernel path under kernels/ or a .cu file");
    let arch = args.get(1).cloned().unwrap_or_else(|| "sm_90a".into());
    let defines: Vec<(String, String)> = args.iter().skip(2).filter_map(|a| a.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))).collect();
    let d: Vec<(&str, String)> = defines.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let nv = dsv4_cuda::nvrtc::nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let result = match std::fs::read_to_string(path) {
        Ok(src) => {
            let mut rendered: String = d.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect();
            rendered.push_str(&src);
            nv.compile_rendered(path, &rendered, &arch)
        }
        Err(_) => nv.compile(path, &d, &arch),
    };
    match result {
        Ok(c) => {
            println!("{}", c.log);
            if let Ok(out) = std::env::var("DSV4_CUBIN_OUT") {
                std::fs::write(&out, &c.cubin).unwrap_or_else(|e| panic!("writing {out}: {e}"));
            }
        }
        Err(e) => println!("{e}"),
    }
}
