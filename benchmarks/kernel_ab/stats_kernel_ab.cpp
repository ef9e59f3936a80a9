// Single-thread A/B of the AVX2 stats kernel: the working tree's csrc/cpu/stats_clip_kernels_avx2.cpp
// against the stats kernels (kernels_impl.h) of an older commit (old_impl.h, made by run.sh),
// interleaved, medians of 11;
// "read" is a plain 4-accumulator AVX2 sum over the same bytes. "hot" rows reread a 128 KB
// (fp32) / 64 KB (16-bit) tensor 2000 times: the in-cache compute rate per core.
#include "../../csrc/cpu/stats_clip_kernels_avx2.cpp"
#include "old_impl.h"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <algorithm>
#include <cstdlib>
using namespace gradfuse;
using namespace gradfuse::cpu;
using Fn = void(*)(const ChunkArgs&, PowMode, double, int64_t, int64_t, void*, int64_t*, double*, int64_t*);
double sink=0;
double run1(Fn f, std::vector<Span>& spans, c10::ScalarType dt) {
  std::vector<int64_t> fc; int64_t next=0;
  for (auto&s:spans){fc.push_back(next); next += (s.numel+kChunkElems-1)/kChunkElems;}
  fc.push_back(next);
  ChunkArgs a{spans.data(), (int64_t)spans.size(), fc.data(), dt};
  std::vector<double> of(spans.size()*kNumFloatStats); std::vector<int64_t> oc(spans.size()*kNumCountStats);
  auto t0=std::chrono::steady_clock::now();
  f(a, PowMode::kNone, 2.0, 0, next, nullptr, nullptr, of.data(), oc.data());
  double t=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
  sink += of[1]+oc[2]; return t;
}
double readsum(const float* p, int64_t N){auto t0=std::chrono::steady_clock::now();
      __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0; for(int64_t i=0;i<N;i+=32){a0=_mm256_add_ps(a0,_mm256_loadu_ps(&p[i]));a1=_mm256_add_ps(a1,_mm256_loadu_ps(&p[i+8]));a2=_mm256_add_ps(a2,_mm256_loadu_ps(&p[i+16]));a3=_mm256_add_ps(a3,_mm256_loadu_ps(&p[i+24]));}
      float b[8]; _mm256_storeu_ps(b,_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3))); sink+=b[0];
      return std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();}
double med(std::vector<double> v){std::sort(v.begin(),v.end()); return v[v.size()/2];}
int main(int argc, char** argv){ setvbuf(stdout,nullptr,_IONBF,0);
  std::string which = argc>1?argv[1]:"big";
  std::mt19937 g(0); std::normal_distribution<float> nd;
  const int64_t N = 32<<20;
  std::vector<float> big(N); for(auto&v:big) v=nd(g);
  std::vector<c10::BFloat16> bigb(N); for(int64_t i=0;i<N;++i) bigb[i]=big[i];
  std::vector<c10::Half> bigh(N); for(int64_t i=0;i<N;++i) bigh[i]=big[i];
  std::vector<float*> small; std::vector<Span> ss;
  std::uniform_int_distribution<int> ud(1024,4096);
  std::vector<void*> junk;
  int64_t sb=0;
  for(int i=0;i<10000;++i){int n=ud(g); float* p=(float*)aligned_alloc(64,(n*4+63)/64*64); junk.push_back(malloc(ud(g))); for(int k=0;k<n;++k) p[k]=nd(g); ss.push_back({p,n}); sb+=n*4;}
  std::vector<Span> s1{{big.data(),N}}, s2{{bigb.data(),N}}, s3{{bigh.data(),N}};
  std::vector<Span> hot32, hotb, hoth;
  for (int k=0;k<2000;++k){hot32.push_back({big.data(),32768}); hotb.push_back({bigb.data(),32768}); hoth.push_back({bigh.data(),32768});}
  struct W{const char* name; std::vector<Span>* s; c10::ScalarType dt; int64_t bytes;};
  std::vector<W> ws{{"fp32 big",&s1,c10::ScalarType::Float,N*4},{"bf16 big",&s2,c10::ScalarType::BFloat16,N*2},{"fp16 big",&s3,c10::ScalarType::Half,N*2},{"fp32 small",&ss,c10::ScalarType::Float,sb},{"fp32 hot",&hot32,c10::ScalarType::Float,2000*32768*4},{"bf16 hot",&hotb,c10::ScalarType::BFloat16,2000*32768*2},{"fp16 hot",&hoth,c10::ScalarType::Half,2000*32768*2}};
  for (auto& w: ws) {
    std::vector<double> r,o,nw;
    for (int rep=0;rep<11;++rep){ if (std::string(w.name).find("hot")!=std::string::npos){double t=0; for(int k=0;k<2000;++k) t+=readsum(big.data(),32768); r.push_back(t);} else r.push_back(readsum(big.data(), w.bytes/4)); o.push_back(run1(OLD::stats_tensors,*w.s,w.dt)); nw.push_back(run1(AVX2::stats_tensors,*w.s,w.dt)); }
    double mr=med(r),mo=med(o),mn=med(nw);
    printf("%-10s %.1f/%.1f/%.1f GB/s read/old/new  ", w.name, w.bytes/mr/1e9, w.bytes/mo/1e9, w.bytes/mn/1e9); printf("read %.2fms  old %.2fms (%.0f%%)  new %.2fms (%.0f%%)  new/old speedup %.2fx\n", w.name, mr*1e3, mo*1e3, mr/mo*100, mn*1e3, mr/mn*100, mo/mn);
  }
  printf("%g\n", sink);
}
